"""Batch planning: which tokens the next `llama_decode` carries, and who gives way when none fit.

Invariants:
- decode tokens go first, one per running choice that has sampled, each followed by the draft the
  speculator gave it (every one of them with logits, to be verified); prompt chunks fill the rest
  in admission order;
- a batch never exceeds the token budget, never carries a sequence twice, and carries a sequence's
  tokens only where `KvManager.reserve` found room in its stream (a sequence at its stream's end
  ends with `length`);
- with `prefill_chunk` set (`--prefill-chunk`, off by default), a batch that decodes carries at most
  that many prompt tokens, so a running stream's next token waits for one short step, never a long
  prefill (stall-free batching, as Sarathi-Serve's);
- choice 0's prefill stops at each of its request's checkpoints, where a recurrent state can be saved;
- a step runs under one LoRA adapter set (llama.cpp applies adapters to the whole context), so it
  carries the sequences of one set only: of the sets with work, the one served least recently (ties:
  the set of the earliest admitted request), so with k sets each gets at least every k-th step;
- a step is one `llama_decode`: each sequence has its own stream, and llama.cpp splits the batch
  into per-stream ubatches itself, so a decode token never attends over another sequence's cells;
  the scheduler adds a step's tokens in sequence-id order, for llama.cpp keeps sequences in one
  ubatch only while their ids run consecutively.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.llama.batch import Batch
from kvserve.llama.lora import BASE, AdapterSet
from kvserve.scheduler.config import SchedulerConfig
from kvserve.scheduler.ending import Ending
from kvserve.scheduler.kv_manager import KvManager
from kvserve.scheduler.queues import Queues
from kvserve.scheduler.request import Choice, FinishReason, Request
from kvserve.scheduler.speculation import SpecState, Speculator
from kvserve.scheduler.drafters import Sequence
from kvserve.scheduler.step_output import StepOutputs


@dataclass
class Slot:
    """The next `n_tokens` tokens of one choice in the batch, then its `draft` (guessed tokens after
    them, decoding slots only): the logits of the last known token and of every draft token are
    read from consecutive rows starting at `logits_index`."""

    request: Request
    choice: Choice
    n_tokens: int
    logits_index: int | None = None  # set when this chunk ends the sequence's known tokens
    draft: list[int] = field(default_factory=list)
    drafter: str = ""  # who proposed the draft (metrics)

    @property
    def n_decoded(self) -> int:
        """Tokens this slot puts into the batch."""
        return self.n_tokens + len(self.draft)

    def add_to(self, batch: Batch) -> None:
        session = self.choice.session
        for pos in range(session.n_past, session.n_past + self.n_tokens):
            last = pos == len(self.choice.tokens) - 1
            index = batch.add(self.choice.tokens[pos], pos, session.seq, last)
            if last:
                self.logits_index = index
        for i, token in enumerate(self.draft, start=session.n_past + self.n_tokens):
            batch.add(token, i, session.seq, True)


class BatchPlanner:
    def __init__(self, kv: KvManager, ending: Ending, config: SchedulerConfig, queues: Queues,
                 speculator: Speculator | None = None) -> None:
        self.kv = kv
        self.ending = ending
        self.config = config
        self.queues = queues
        self.speculator = speculator
        self.preemptions = 0
        self.adapters: AdapterSet = BASE  # the adapter set of the last planned step
        self._served: dict[AdapterSet, int] = {}  # the step at which each set was last served
        self._steps = 0

    def plan(self, outputs: StepOutputs) -> list[Slot]:
        """The step's `llama_decode`: one adapter set's decode tokens and their drafts first, then its
        prompt chunks, within budget; a sequence with no room left in its stream ends with `length`."""
        decoding, prefilling = self._resident_slots(outputs)
        self.adapters = self._next_adapters([s.request for s in decoding + prefilling])
        decoding = [s for s in decoding if s.request.adapters == self.adapters]
        prefilling = [s for s in prefilling if s.request.adapters == self.adapters]
        if decoding and self.speculator is not None and self.speculator.enabled:
            waiting = sum(slot.choice.unevaluated for slot in prefilling)
            self._draft(decoding, min(waiting, self._prefill_budget(len(decoding))))
        return decoding + self._prefill_chunks(prefilling, sum(slot.n_decoded for slot in decoding))

    def _draft(self, decoding: list[Slot], n_prefill: int) -> None:
        """Give decoding slots the speculator's drafts, each within its stream's room (`allocate`'s
        lookahead), its request's `max_tokens` and the longest sequence; all within the budget. None
        with a prompt's last token (a prompt cached but for it): the prompt is donated and the
        request's other choices fork from it as evaluated, before any output (`Scheduler._sample`)."""
        speculator = self.speculator
        assert speculator is not None
        spare = self.config.token_budget - len(decoding) - n_prefill
        candidates = []
        for slot in decoding:
            choice, request = slot.choice, slot.request
            if choice.spec is None:
                choice.spec = SpecState(Sequence(choice.tokens, len(request.prompt), request.prediction,
                                                  request.namespace))
            choice.spec.sequence.seq = choice.session.seq
            reserved = self.kv.allocate(choice, 1, speculator.config.draft_max) or 1
            limit = min(reserved - 1, request.max_tokens - choice.n_generated - 1,
                        self.config.max_seq_len - len(choice.tokens), max(spare, 0)) if choice.n_generated else 0
            candidates.append((choice.spec, limit))
        for slot, (draft, drafter) in zip(decoding, speculator.choose(candidates, n_prefill)):
            draft = draft[: max(spare, 0)]
            slot.draft, slot.drafter = draft, drafter
            spare -= len(draft)

    def _next_adapters(self, requests: list[Request]) -> AdapterSet:
        """Of the adapter sets with work, the one served least recently (first come on a tie)."""
        self._steps += 1
        sets = list(dict.fromkeys(r.adapters for r in requests))  # in admission order
        if len(sets) <= 1:
            chosen = sets[0] if sets else self.adapters
        else:
            chosen = min(sets, key=lambda a: self._served.get(a, -1))
        self._served = {a: self._served.get(a, -1) for a in sets}  # forget sets without work
        self._served[chosen] = self._steps
        return chosen

    def shed_load(self, outputs: StepOutputs) -> None:
        """llama.cpp found no room: the newest request gives its sequences back (donating what it
        evaluated) and waits at the head of the queue with its output so far; it resumes where it
        stopped. A request alone in the context ends with `length`."""
        if len(self.queues.running) == 1:
            self.ending.end(self.queues.running[0], FinishReason.LENGTH, outputs)
            return
        request = self.queues.running.pop()
        self.preemptions += 1
        self.kv.release(request, donate=True)
        for choice in request.state.choices:
            choice.waits_for_fork = False  # siblings that never forked restart from the prompt
        self.queues.waiting.appendleft(request)

    def _resident_slots(self, outputs: StepOutputs) -> tuple[list[Slot], list[Slot]]:
        """Slots of one decode token each, and prefill slots whose size `_prefill_chunks` decides."""
        decoding: list[Slot] = []
        prefilling: list[Slot] = []
        for request in list(self.queues.running):
            if any(c.active and c.unevaluated == 1 and not self.kv.reserve(c, 1) for c in request.state.choices):
                self.ending.end(request, FinishReason.LENGTH, outputs)  # a sequence filled its stream
                continue
            for choice in request.state.choices:
                if choice.active:
                    (decoding if choice.unevaluated == 1 else prefilling).append(Slot(request, choice, 1))
        return decoding, prefilling

    def _prefill_chunks(self, prefilling: list[Slot], planned: int) -> list[Slot]:
        """Prompt chunks in admission order after `planned` decode tokens, until the budget runs out."""
        chunks: list[Slot] = []
        budget = self._prefill_budget(planned)
        for slot in prefilling:
            slot.n_tokens = min(slot.choice.unevaluated, budget, _to_next_checkpoint(slot))
            if slot.n_tokens <= 0:
                break
            if not self.kv.reserve(slot.choice, slot.n_tokens):  # admission saw the prompt fit its stream
                raise RuntimeError("a prompt outgrew its stream")
            chunks.append(slot)
            budget -= slot.n_tokens
        return chunks

    def _prefill_budget(self, n_decoding: int) -> int:
        budget = self.config.token_budget - n_decoding
        if n_decoding and self.config.prefill_chunk is not None:
            budget = min(budget, self.config.prefill_chunk)  # a running stream never waits through a long prefill
        return budget


def _to_next_checkpoint(slot: Slot) -> int:
    """A recurrent state can only be saved where the sequence stands, so prefill stops there."""
    n_past = slot.choice.session.n_past
    ahead = [p for p in slot.request.state.checkpoints if p > n_past] if slot.choice.index == 0 else []
    return min(ahead) - n_past if ahead else slot.choice.unevaluated
