"""How ranks talk (layer 2): the byte transports (torch.distributed, one process, threads) and the
Communicator, whose every phase ends in agreement."""
