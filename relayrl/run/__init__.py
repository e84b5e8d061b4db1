"""Running: build a run's components from its config (`build`), the training loops (`loop`), checkpoints and
exact resume (`checkpoint`), where rollouts come from (`sources`: in this process or a producer process) and
where processes are placed (locally, or on Ray). The top of the house: it imports every component below it."""
