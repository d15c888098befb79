"""The KV side of requests: the session each choice holds in the pool, and what the prefix cache
gives a request when it starts and takes from it as it goes and when it ends.

Invariants:
- a session holds exactly the tokens llama.cpp has for its seq id: `commit` appends what a decode
  evaluated, nothing else does;
- a choice holds a session from its start until its request ends or is preempted; `release` frees
  every one of them;
- a forked choice never donates: its prompt cells are choice 0's;
- checkpoints are planned and taken for choice 0 only, whose prefill stops at each of them.
"""

from __future__ import annotations

from kvserve.cache.kv_pool import KvPool, PoolExhausted
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.scheduler.request import Choice, Request


class KvManager:
    def __init__(self, pool: KvPool, cache: PrefixCache) -> None:
        self.pool = pool
        self.cache = cache
        self.model = pool.ctx.model

    # -- room ---------------------------------------------------------------------------------------------

    @property
    def free_cells(self) -> int:
        return self.pool.free_cells

    def make_room(self, cells: int) -> bool:
        """Whether `cells` cells are free, after the cache gave back cold entries for them."""
        return self.pool.make_room(cells)

    def cached_len(self, prompt: list[int]) -> int:
        """Leading tokens of `prompt` that the cache would attach now."""
        return self.cache.match_len(prompt)

    def gains_from_waiting(self, shared: int, cached: int) -> bool:
        return self.cache.gains_from_waiting(shared, cached)

    # -- starting ---------------------------------------------------------------------------------------

    def open_sessions(self, request: Request, choices: list[Choice]) -> bool:
        """A fresh session for each of `choices`; False, with none held, when sequence ids ran out."""
        try:
            for choice in choices:
                choice.session = self.pool.new_session()
        except PoolExhausted:
            self.release(request, donate=False)
            return False
        return True

    def attach_cached(self, request: Request, choices: list[Choice]) -> None:
        """Attach to each choice's fresh session what the cache holds of its tokens."""
        for choice in choices:
            attached = self.cache.attach(choice.session, choice.tokens)
            request.state.cached_tokens = max(request.state.cached_tokens, min(attached, len(request.prompt)))

    def plan_checkpoints(self, request: Request) -> None:
        """Keep the request's marks at which a checkpoint of choice 0 is worth a stop of its prefill."""
        session = request.state.choices[0].session
        request.state.checkpoints = {
            mark.position: mark.kind for mark in request.marks
            if self.cache.checkpoint_at(session, request.prompt, session.n_past, mark.position)
        }

    # -- after a decode -----------------------------------------------------------------------------------

    @staticmethod
    def commit(choice: Choice, n_tokens: int) -> None:
        """The decode evaluated the choice's next `n_tokens` tokens: its session holds them now."""
        session = choice.session
        session.tokens.extend(choice.tokens[session.n_past : session.n_past + n_tokens])

    def checkpoint_if_at_mark(self, request: Request, choice: Choice) -> None:
        session = choice.session
        kind = request.state.checkpoints.get(session.n_past) if choice.index == 0 else None
        if kind is not None:
            self.cache.insert(session, session.tokens, preview=self._preview(request), kind=kind)

    def donate_evaluated_prompt(self, request: Request, choice: Choice) -> None:
        """Insert the prompt the moment `choice` has evaluated it, so requests waiting on this prefix
        attach it now rather than when the request ends."""
        if self.cache.donates_prompt and choice.session.n_past == len(request.prompt) and not choice.forked:
            self.cache.insert(choice.session, choice.session.tokens, preview=self._preview(request))

    def fork_waiting_siblings(self, request: Request, parent: Choice) -> list[Choice]:
        """The prompt is evaluated: the siblings waiting for it share the parent's cells from here."""
        siblings = [c for c in request.state.choices if c.waits_for_fork]
        for sibling in siblings:
            self.pool.fork(parent.session, sibling.session)
            sibling.waits_for_fork = False
            sibling.forked = True
        return siblings

    # -- the end --------------------------------------------------------------------------------------------

    def release(self, request: Request, donate: bool) -> None:
        """Free every session of the request; unforked ones first donate what they evaluated to the
        cache. Forked siblings go first: their prompt cells are accounted to choice 0."""
        resident = [c for c in request.state.choices if c.session is not None]
        resident.sort(key=lambda c: not c.forked)
        for choice in resident:
            session = choice.session
            if donate and not choice.forked:
                self.cache.insert(session, session.tokens, preview=self._preview(request))
            self.pool.end_session(session)
            choice.session = None
            choice.forked = False

    def _preview(self, request: Request) -> str:
        return self.model.detokenize(request.prompt[-24:])
