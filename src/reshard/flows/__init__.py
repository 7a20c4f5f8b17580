"""The operations a user calls (layer 6): save, load, async save, the manager, maintenance, transfer, the
peer tier, and their options and statistics."""
