"""Moving weights from the trainer to the engines: through files (`transport.DiskSender`/`DiskReceiver`, the
`weights` folder a server reads) or through a torch.distributed group (`weight_group`, NCCL or gloo)."""
