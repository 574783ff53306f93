"""How a synced backward fails: the errors every rank raises together."""
from __future__ import annotations


class SyncError(RuntimeError):
    """Ranks disagreed, a rank failed, or a collective did not finish within the timeout."""


class PeerFailure(SyncError):
    """With a commit protocol: a collective failed or did not finish (a peer died or left the group)."""


class ReplicaMismatchError(SyncError):
    """``check_replicas``: ranks hold different parameters or reduced gradients where they must hold the same bits."""


__all__ = ["PeerFailure", "ReplicaMismatchError", "SyncError"]
