"""What a run leaves to look at: metrics (metrics.jsonl always, plus TensorBoard, offline wandb or a local mlflow
store per run.trackers), the console table and progress lines, trajectories (every sample's text and tokens) and
plots of them."""
