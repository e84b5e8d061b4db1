"""The training side: the algorithm (`algo`), the Packer, the TrainEngine and the TrainController."""

from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import MicroBatch, Packer, TrainBatch

__all__ = ["MicroBatch", "Packer", "TrainBatch", "TrainController", "TrainEngine"]
