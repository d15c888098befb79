"""A draft model (`--draft-model`): a second llama context, on the engine thread, with a stream per
target stream, whose greedy guesses draft for every sequence that wants one, in one batch per
draft decode.

Invariants:
- draft stream `seq` serves the target's stream `seq`, and `held[seq]` is exactly what it holds
  (positions `0 .. len-1`);
- it holds a prefix of its target sequence's tokens plus the draft proposed this step, never
  more: a draft step first cuts it to its common prefix with the sequence's tokens, `cut` drops
  what verification did not keep (`KvManager.commit`), and `trim` follows the target stream when it
  is placed, forked or freed (a stream reused in place keeps its draft rows too; an attached
  cached prefix is not in them, so the draft evaluates it at its next draft step);
- a draft step is one decode that catches every drafting sequence up (its missing tokens, at least
  its last one, whose logits give the first guess; chunked by `n_batch`), then one decode per
  further guess, batched over the sequences still drafting; a guess that ends generation ends its
  draft;
- `cost` is timed on the decodes of one token per sequence (seconds by sequences drafted), the steady state
  of drafting; a longer catch-up is an entry cost, counted in `catchup_tokens`/`catchup_seconds`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from kvserve.cache.kv_pool import common_prefix
from kvserve.llama.batch import Batch
from kvserve.llama.context import Context, ContextParams, DecodeError, FlashAttn
from kvserve.llama.model import Model
from kvserve.scheduler.ubatch_cost import UbatchCost

_log = logging.getLogger("kvserve.draft")


def check_draft_model(target: Model, draft: Model) -> None:
    """ValueError, in one line, where `draft` cannot draft for `target`."""
    problem = target.vocab_mismatch(draft)
    if problem:
        raise ValueError(f"--draft-model {draft.info.path}: its vocabulary differs from the model's ({problem})")
    if draft.info.carries_state or draft.info.n_swa:
        raise ValueError(f"--draft-model {draft.info.path}: a recurrent or sliding-window model's rows cannot be "
                         "cut back, so it cannot draft")


class DraftModel:
    name = "draft"
    prior = 0.6
    watch_first = False

    def __init__(self, path: Path, target: Context, n_threads: int, flash_attn: FlashAttn = "auto") -> None:
        self.model = Model(path)
        try:
            check_draft_model(target.model, self.model)
            self.ctx = Context(self.model, ContextParams(
                n_ctx_seq=target.n_ctx_seq, n_batch=target.n_batch, n_seq_max=target.n_seq_max,
                n_threads=n_threads, flash_attn=flash_attn))
        except Exception:
            self.model.close()
            raise
        self.path = str(path)
        self.held: list[list[int]] = [[] for _ in range(target.n_seq_max)]
        self.cost = UbatchCost({1: 0.0055, 64: 0.037})  # by sequences drafted in a step
        self.catchup_tokens = 0  # tokens decoded beyond one per sequence to catch streams up
        self.catchup_seconds = 0.0
        self._batch = Batch(self.ctx.n_batch)

    def describe(self) -> dict:
        return {"draft_model": self.path, "draft_model_name": Path(self.path).stem,
                "draft_step_seconds": {str(n): round(t, 5) for n, (t, _) in self.cost.entries().items()},
                "draft_catchup_tokens": self.catchup_tokens}

    # -- following the target streams ----------------------------------------------------------------

    def cut(self, seq: int, n: int) -> None:
        """Keep at most the first `n` rows of `seq`."""
        held = self.held[seq]
        if len(held) > n:
            self.ctx.seq_rm(seq, n, -1)
            del held[n:]

    def trim(self, seq: int, tokens: list[int]) -> None:
        """Keep the rows of `seq` that are a prefix of `tokens`."""
        self.cut(seq, common_prefix(self.held[seq], tokens))

    def missing(self, seq: int, tokens: list[int]) -> int:
        """Tokens a draft step would decode to catch `seq` up to `tokens` (at least the last one)."""
        return len(tokens) - min(common_prefix(self.held[seq], tokens), len(tokens) - 1)

    # -- drafting -------------------------------------------------------------------------------------

    def draft(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """For each (seq, tokens, k): up to `k` greedy guesses of the tokens after `tokens`. A decode
        that fails leaves those streams empty and drafts nothing. Sequences go into each batch in
        id order (llama.cpp puts sequences into one ubatch only while their ids run consecutively)."""
        order = sorted(range(len(wants)), key=lambda i: wants[i][0])
        by_seq = self._draft_sorted([wants[i] for i in order])
        guesses: list[list[int]] = [[] for _ in wants]
        for i, draft in zip(order, by_seq):
            guesses[i] = draft
        return guesses

    def _draft_sorted(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        try:
            guesses = self._catch_up(wants)
            for _ in range(1, max((k for _, _, k in wants), default=0)):
                going = [i for i, (_, _, k) in enumerate(wants)
                         if 0 < len(guesses[i]) < k and not self.model.is_eog(guesses[i][-1])]
                if not going:
                    break
                rows = self._decode([(wants[i][0], guesses[i][-1], True) for i in going])
                for i, row in zip(going, rows):
                    guesses[i].append(self._argmax(row))
            return guesses
        except DecodeError as exc:
            _log.warning("draft decode failed (%s): no drafts this step", exc)
            for seq, _, _ in wants:
                self.cut(seq, 0)
            return [[] for _ in wants]

    def _catch_up(self, wants: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """Decode what each stream misses of its tokens; the first guess of each."""
        entries: list[tuple[int, int, bool]] = []  # seq, token, last of its sequence
        for seq, tokens, _ in wants:
            keep = min(common_prefix(self.held[seq], tokens), len(tokens) - 1)
            self.cut(seq, keep)
            entries += [(seq, tokens[pos], pos == len(tokens) - 1) for pos in range(keep, len(tokens))]
        first: dict[int, int] = {}
        for start in range(0, len(entries), self.ctx.n_batch):
            chunk = entries[start : start + self.ctx.n_batch]
            rows = iter(self._decode(chunk))
            for seq, _, last in chunk:
                if last:
                    first[seq] = self._argmax(next(rows))
        return [[first[seq]] if k > 0 else [] for seq, _, k in wants]

    def _decode(self, entries: list[tuple[int, int, bool]]) -> list[int]:
        """Decode (seq, token, wants logits) after what each stream holds; the logits rows of those
        that want them, in order."""
        batch = self._batch
        batch.clear()
        rows = []
        for seq, token, logits in entries:
            index = batch.add(token, len(self.held[seq]), seq, logits)
            self.held[seq].append(token)  # positions follow the held rows; undone below on failure
            if logits:
                rows.append(index)
        started = time.perf_counter()
        try:
            self.ctx.decode(batch)
        except DecodeError:
            for seq, _, _ in entries:
                self.held[seq].pop()
            raise
        seconds = time.perf_counter() - started
        n_sequences = len({seq for seq, _, _ in entries})
        if len(entries) == n_sequences:
            self.cost.observe([n_sequences], seconds)
        else:
            self.catchup_tokens += len(entries) - n_sequences
            self.catchup_seconds += seconds
        return rows

    def _argmax(self, row: int) -> int:
        return int(np.argmax(self.ctx.logits(row)))

    def close(self) -> None:
        self._batch.close()
        self.ctx.close()
        self.model.close()
