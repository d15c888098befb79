"""Batch planning: which tokens the next `llama_decode` carries, and who gives way when none fit.

Invariants:
- decode tokens go first, one per running choice that has sampled; prompt chunks fill the rest in
  admission order;
- a batch never exceeds the token budget, never outruns free KV cells (the cache evicts, then the
  newest running request is preempted), and never carries a sequence twice;
- with `prefill_chunk` set (`--prefill-chunk`, off by default), a batch that decodes carries at most
  that many prompt tokens, so a running stream's next token waits for one short step, never a long
  prefill (stall-free batching, as Sarathi-Serve's);
- choice 0's prefill stops at each of its request's checkpoints, where a recurrent state can be saved;
- with flash attention, decode tokens and prompt chunks go to separate `llama_decode` calls, each
  under the kernel's tile rows for decodes, unless all of them together are under it: a decode
  token sharing a tile with a prompt makes that tile attend over every cell of both sequences
  (measured: 8 decodes riding in a 64-token chunk cost 477 ms, 276 ms as two calls; 64 decodes
  cost 668 ms as one call, 378 ms as 63 + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.llama.batch import Batch
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.ending import Ending
from kvserve.scheduler.kv_manager import KvManager
from kvserve.scheduler.queues import Queues
from kvserve.scheduler.request import Choice, FinishReason, Request
from kvserve.scheduler.step_output import StepOutputs


@dataclass
class Slot:
    """The next `n_tokens` tokens of one choice in the batch."""

    request: Request
    choice: Choice
    n_tokens: int
    logits_index: int | None = None  # set when this chunk ends the sequence's known tokens

    def add_to(self, batch: Batch) -> None:
        session = self.choice.session
        for pos in range(session.n_past, session.n_past + self.n_tokens):
            last = pos == len(self.choice.tokens) - 1
            index = batch.add(self.choice.tokens[pos], pos, session.seq, last)
            if last:
                self.logits_index = index


class BatchPlanner:
    def __init__(self, kv: KvManager, ending: Ending, config: SchedulerConfig, queues: Queues) -> None:
        self.kv = kv
        self.ending = ending
        self.config = config
        self.queues = queues
        self.preemptions = 0

    def plan(self, outputs: StepOutputs) -> list[list[Slot]]:
        """The step's `llama_decode` calls: decode tokens first, then prompt chunks, within budget and
        free cells (cold cache pages are evicted for either). A step in which nothing could move sheds
        the newest request, so running requests never wait on cells that only an idle cache or a later
        request holds."""
        decoding, prefilling = self._slots_with_room_to_decode(outputs)
        chunks = self._prefill_chunks(prefilling, len(decoding))
        if not decoding and not chunks:
            if prefilling:
                self.shed_load(outputs)
            return []
        return split_into_calls(decoding, chunks, self.config.attention_tile_rows)

    def shed_load(self, outputs: StepOutputs) -> None:
        """Out of cells: the newest request gives its sequences back (donating what it evaluated) and
        waits at the head of the queue with its output so far; it resumes where it stopped. A request
        alone in the context has filled it, and ends with `length`."""
        if len(self.queues.running) == 1:
            self.ending.end(self.queues.running[0], FinishReason.LENGTH, outputs)
            return
        request = self.queues.running.pop()
        self.preemptions += 1
        self.kv.release(request, donate=True)
        for choice in request.state.choices:
            choice.waits_for_fork = False  # siblings that never forked restart from the prompt
        self.queues.waiting.appendleft(request)

    def _slots_with_room_to_decode(self, outputs: StepOutputs) -> tuple[list[Slot], list[Slot]]:
        """The resident slots, once every decoding one has a free cell (shedding load until it does)."""
        decoding, prefilling = self._resident_slots()
        while decoding and not self.kv.make_room(len(decoding)):
            self.shed_load(outputs)
            decoding, prefilling = self._resident_slots()
        return decoding, prefilling

    def _resident_slots(self) -> tuple[list[Slot], list[Slot]]:
        """Slots of one decode token each, and prefill slots whose size `_prefill_chunks` decides."""
        decoding: list[Slot] = []
        prefilling: list[Slot] = []
        for request in self.queues.running:
            for choice in request.state.choices:
                if choice.active:
                    (decoding if choice.unevaluated == 1 else prefilling).append(Slot(request, choice, 1))
        return decoding, prefilling

    def _prefill_chunks(self, prefilling: list[Slot], planned: int) -> list[Slot]:
        """Prompt chunks in admission order after `planned` decode tokens, until budget or cells run out."""
        chunks: list[Slot] = []
        budget = self._prefill_budget(planned)
        for slot in prefilling:
            wanted = min(slot.choice.unevaluated, budget, _to_next_checkpoint(slot))
            self.kv.make_room(planned + wanted)
            slot.n_tokens = min(wanted, self.kv.free_cells - planned)
            if slot.n_tokens <= 0:
                break
            chunks.append(slot)
            budget -= slot.n_tokens
            planned += slot.n_tokens
        return chunks

    def _prefill_budget(self, n_decoding: int) -> int:
        budget = self.config.token_budget - n_decoding
        if n_decoding and self.config.prefill_chunk is not None:
            budget = min(budget, self.config.prefill_chunk)  # a running stream never waits through a long prefill
        return budget


def split_into_calls(decoding: list[Slot], chunks: list[Slot], tile_rows: int | None) -> list[list[Slot]]:
    """One call, unless it would reach `tile_rows` tokens: then decode tokens in calls under it, and
    the prompt chunks after them."""
    if tile_rows is None or len(decoding) + sum(c.n_tokens for c in chunks) < tile_rows:
        return [decoding + chunks]
    calls = [decoding[i:i + tile_rows - 1] for i in range(0, len(decoding), tile_rows - 1)]
    return calls + [chunks] if chunks else calls


def _to_next_checkpoint(slot: Slot) -> int:
    """A recurrent state can only be saved where the sequence stands, so prefill stops there."""
    n_past = slot.choice.session.n_past
    ahead = [p for p in slot.request.state.checkpoints if p > n_past] if slot.choice.index == 0 else []
    return min(ahead) - n_past if ahead else slot.choice.unevaluated
