"""The control plane: block manager, sequences and groups, scheduling policy. Never imports torch."""
from scheduler.block_manager import BlockManager, NoFreeBlocksError
from scheduler.scheduler import Scheduler
from scheduler.sequence import RequestOutput, Sequence, SequenceGroup, SequenceOutput, SequenceStatus

__all__ = [
    "BlockManager", "NoFreeBlocksError", "Scheduler", "RequestOutput", "Sequence", "SequenceGroup",
    "SequenceOutput", "SequenceStatus",
]
