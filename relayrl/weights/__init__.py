"""Moving weights from the trainer to the engines. What a trainer hands over is a `snapshot.Weights` (named tensors
and their version); in another process they arrive through files (`transport.DiskSender`/`DiskReceiver`, the
`weights` folder a server reads) or through a torch.distributed group (`weight_group`, NCCL or gloo)."""
