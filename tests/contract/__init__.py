"""The contract and fault suite: the guarantees every flow of reshard keeps, stated once, and the fault
sources every flow is run through.

**The guarantees** (:mod:`tests.contract.guarantees`, functions over what a flow returned and what is on
disk; every flow is checked by the same functions):

1. *No silent wrong bytes*: a load (or a restore, a transfer) returns exactly the bytes of one committed
   save, or raises a reshard error (:class:`reshard.CheckpointError`).
2. *Nothing lost*: no committed checkpoint becomes unloadable through reshard's own actions (a retention
   policy deletes what it is told to, nothing more), and a save that any rank reported done is the one a
   load finds.
3. *Nothing touched outside*: no file that reshard did not write is deleted or changed, and no file outside
   the checkpoint (and the sibling checkpoints it references) is opened.
4. *The same error on every rank*: every failure is a reshard error, and the ranks that fail fail with the
   same class (the one asymmetry allowed is the commit's: some ranks confirmed, the others raise
   :class:`reshard.UnconfirmedCommitError`).
5. *No hang*: every surviving rank answers within its timeout.

**The fault sources**, each a module with its sampled test in ``make test`` and its long mode in
``python -m benchmarks.chaos --all-flows``:

- kill -9 of any rank before or after any event (collective, storage operation, file-system call) and at
  random delays (:mod:`tests.contract.harness`, flows in :mod:`tests.contract.flows`);
- seeded corruption of every artefact a flow leaves (:mod:`tests.contract.damage`);
- hostile documents of every format version, with every file the readers open recorded
  (:mod:`tests.contract.hostile`);
- options that disagree across ranks, for every option object (:mod:`tests.contract.disagreement`);
- hostile tensors on one rank (meta, expanded, freed, sparse, two primaries of one box, conjugate views)
  for the flows that move tensors between ranks (:mod:`tests.contract.hostile_tensors`);
- concurrent misuse: two managers on one root, an overwrite during a load, a copied or moved step
  (:mod:`tests.contract.misuse`).

A new flow, or a new mode of an old one, is not done until it is a flow here (docs/architecture.md,
"Adding a flow").
"""
