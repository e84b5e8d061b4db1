"""What a run leaves to look at: metrics (metrics.jsonl, TensorBoard, the console table), trajectories (every
sample's text and tokens) and plots of them."""
