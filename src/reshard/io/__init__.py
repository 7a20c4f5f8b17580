"""The checkpoint I/O layer between the save and load flows and the storage backends.

- :mod:`reshard.io.checksums`: chunked CRC-32C, and the chunks a read touches;
- :mod:`reshard.io.device`: tensor bytes between GPU memory and pinned host buffers, on side streams;
- :mod:`reshard.io.datafile`: data file names, alignment, and the writer of checksummed ranges;
- :mod:`reshard.io.commit`: the commit protocol, the only code that writes ``metadata.json``;
- :mod:`reshard.io.verified`: reads of stored ranges, the verification of their chunks, a load's budget shares;
- :mod:`reshard.io.chunkgroups`: read items that share checksum chunks, read once through one stream;
- :mod:`reshard.io.reader`: the read executor, which verifies every byte a load uses;
- :mod:`reshard.io.reuse`: which boxes an incremental save references, each read back from its base and proven
  to be the state's bytes first.

``reshard.save``, ``reshard.load`` and the single-process tools (``reshard.interop.offline``) all go
through these modules, so that the guarantees of docs/reliability.md hold the same way everywhere.
"""
