"""Which LoRA adapter each of the workers' `max_loras` slots holds (torch-free, like the block manager).

A running request pins its adapter's slot: the scheduler never plans more distinct adapters in a
step than there are slots, and never reloads a slot a running request reads. An adapter no running
request uses stays loaded (idle) until a slot is needed: a free slot first, then the least
recently used idle one is evicted. When every slot is pinned, a request of another adapter waits
(the scheduler goes on with the requests it can run) rather than thrash.

Keys are LoRARequest.key, (lora_int_id, lora_path): an adapter reloaded from another path is
another adapter.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable

from common.protocol import LoRARequest, StepPlan
from scheduler.sequence import SequenceGroup


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: dict[tuple[int, str], int] = {}  # loaded adapters
        self.pins: dict[tuple[int, str], int] = {}  # adapter -> running requests using it (> 0)
        self.idle: OrderedDict[tuple[int, str], None] = OrderedDict()  # loaded, unpinned: least recently used first
        self.free = list(range(max_loras - 1, -1, -1))  # pop() takes slot 0 first
        self.names: dict[tuple[int, str], str] = {}
        self.num_loads = 0
        self.num_evictions = 0

    def available(self, lora: LoRARequest) -> bool:
        """Whether `acquire` would succeed now."""
        return lora.key in self.slot_of or bool(self.free) or bool(self.idle)

    def acquire(self, lora: LoRARequest) -> tuple[int, bool] | None:
        """Pin the adapter's slot for one more running request: (slot, whether the workers must load
        it first), or None when every slot is pinned by other adapters."""
        key = lora.key
        slot = self.slot_of.get(key)
        load = False
        if slot is None:
            if self.free:
                slot = self.free.pop()
            elif self.idle:
                evicted, _ = self.idle.popitem(last=False)
                slot = self.slot_of.pop(evicted)
                self.names.pop(evicted, None)
                self.num_evictions += 1
            else:
                return None
            self.slot_of[key] = slot
            self.names[key] = lora.lora_name
            self.num_loads += 1
            load = True
        self.idle.pop(key, None)
        self.pins[key] = self.pins.get(key, 0) + 1
        return slot, load

    def release(self, lora: LoRARequest) -> None:
        """One running request of the adapter stopped (finished, preempted or failed)."""
        key = lora.key
        count = self.pins[key] - 1
        if count:
            self.pins[key] = count
        else:
            del self.pins[key]
            self.idle[key] = None

    def invalidate(self, slot: int) -> None:
        """The workers hold nothing in `slot` (its load failed): free, once nothing pins it."""
        key = next((k for k, s in self.slot_of.items() if s == slot), None)
        if key is None or key in self.pins:
            return
        del self.slot_of[key]
        self.idle.pop(key, None)
        self.names.pop(key, None)
        self.free.append(slot)

    def pin(self, group: SequenceGroup, plan: StepPlan) -> bool:
        """Pin the group's adapter slot before it runs (a load into the plan if the slot must be
        filled); False when every slot is pinned by other adapters."""
        if group.lora_slot >= 0:
            return True
        acquired = self.acquire(group.lora)
        if acquired is None:
            return False
        group.lora_slot, load = acquired
        if load:
            plan.lora_loads.append([group.lora_slot, group.lora])
        return True

    def unpin(self, group: SequenceGroup) -> None:
        """The group stopped running (preempted, finished, failed): its slot may be reused."""
        if group.lora_slot >= 0:
            self.release(group.lora)
            group.lora_slot = -1

    def status(self, not_running: Iterable[SequenceGroup]) -> dict:
        """SchedulerStatus's LoRA fields (vLLM's lora_requests_info and the slots' counters)."""
        waiting = {g.lora.lora_name for g in not_running if g.lora is not None}
        return {"running_lora_adapters": self.running_names(), "waiting_lora_adapters": sorted(waiting),
                "max_loras": self.max_loras, "num_lora_loads_total": self.num_loads,
                "num_lora_evictions_total": self.num_evictions}

    def running_names(self) -> list[str]:
        return sorted(self.names[key] for key in self.pins)

    def check_integrity(self) -> None:
        slots = list(self.slot_of.values())
        assert len(set(slots)) == len(slots), "two adapters in one slot"
        assert sorted(slots + self.free) == list(range(self.max_loras)), "a slot lost or counted twice"
        assert set(self.pins) | set(self.idle) == set(self.slot_of) and not set(self.pins) & set(self.idle)
        assert all(count > 0 for count in self.pins.values())


class LoRAPins:
    """A base of Scheduler over its `lora_slots` (None without --enable-lora), groups and queues."""

    def _pin_lora(self, group: SequenceGroup, plan: StepPlan) -> bool:
        """False when the group's adapter waits for a slot; no adapter: True."""
        return group.lora is None or self.lora_slots.pin(group, plan)

    def lora_status(self) -> dict:
        if self.lora_slots is None:
            return {}
        return self.lora_slots.status(itertools.chain(self.waiting, self.swapped))

    def _fail_lora_slot(self, slot: int, message: str) -> None:
        """The workers could not load the adapter of `slot`: the requests pinning it fail (and only
        they), and the slot is empty again (a later request of that adapter loads it anew)."""
        for group in [g for g in self.groups.values() if g.lora_slot == slot]:
            self._fail(group, RuntimeError(message))
        self.lora_slots.invalidate(slot)
