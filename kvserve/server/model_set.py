"""The models one server holds: each loaded on its first request, unloaded when idle past its
keep-alive, or to make room under `--models-max` and `--models-mb`, least recently used first.

A request takes a `Lease` on its model (`ModelSet.lease`); the lease ends when its response has
been sent, streamed bodies included (`ReleaseLeases`, the outermost middleware), so a model is never
closed under a request that still reads it.

Invariants:
- a model is unloaded only while no lease holds it, and never when pinned (`--model` alone pins it);
- a probe (`probe`: `/v1/cache`, `/server_info`) loads no model and restarts no keep-alive;
- at most `--models-max` models are loaded or loading, and their footprints together with the prefix
  cache's budget stay within `--models-mb`; a load that cannot make room is a 503 that says why;
- loads and unloads run one at a time (`_lock`); a request for a loading model waits for that load;
- a model that failed to load answers its requests with why, until its file changes; the others serve;
- an unloaded model keeps its prefix cache (`kept`) for its next load only while its file is the same
  one (path, inode, size and mtime): rows never reach another file's model. At most `--models-max`
  caches live at once, loaded or kept, each within `--prefix-state-mb / --models-max`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, TypeVar

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.cache.disk_store import CLOSE_WAIT_S
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.config import Settings, machine_bytes
from kvserve.llama.model import peek_kind
from kvserve.scheduler.engine import Engine
from kvserve.server.catalog import ModelSpec, keep_alive_seconds
from kvserve.server.errors import APIError, shutting_down
from kvserve.server.persistence import Persistence

T = TypeVar("T")
_log = logging.getLogger("kvserve.models")
MIB = 1024 * 1024


class Status(str, Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"


FileId = tuple[str, int, int, int]  # a model file's target path, inode, size and mtime


@dataclass(eq=False)
class ServedModel:
    spec: ModelSpec
    engine: Engine | None = None
    loading: asyncio.Task | None = None
    error: str | None = None  # why the last load failed
    failed_file: FileId | None = None  # the file that failed: retried once it changes
    loaded_file: FileId | None = None  # the file its engine (or its kept cache) was read from
    kept: PrefixCache | None = None  # its cache while unloaded, for its next load of `loaded_file`
    leases: int = 0
    last_used: float = 0.0  # monotonic
    keep_alive: float = 300.0  # seconds idle before it unloads; < 0 never
    footprint: int = 0  # bytes it holds, or held when last loaded (`Engine.memory_bytes`)
    kind: str | None = None  # chat or embedding, read from the file before it loads (`peek_kind`)
    kind_file: FileId | None = None  # the file `kind` was read from

    @property
    def status(self) -> Status:
        if self.engine is not None:
            return Status.LOADED
        return Status.LOADING if self.loading is not None else Status.UNLOADED

    @property
    def evictable(self) -> bool:
        return self.engine is not None and self.leases == 0 and not self.spec.pinned

    @property
    def caches(self) -> bool:
        """It keeps a prefix cache when loaded (an embedding model keeps none: no KV rows to page)."""
        if self.engine is not None:
            return self.engine.cache.keeps != "none"
        return self.kind != "embedding" and self.spec.settings.prefix_cache

    def release_kept(self) -> None:
        if self.kept is not None:
            self.kept.release()
            self.kept = None

    def expired(self, now: float) -> bool:
        return self.evictable and self.keep_alive >= 0 and now - self.last_used >= self.keep_alive


@dataclass(eq=False)
class Lease:
    model: ServedModel
    engine: Engine
    released: bool = False
    used: bool = True  # a request's use, which restarts its keep-alive; a probe's is none

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.model.leases -= 1
            if self.used:
                self.model.last_used = time.monotonic()


def not_found(name: str | None) -> APIError:
    if name is None:
        return APIError(400, "model is required: this server serves several models (GET /v1/models lists them)",
                        param="model", code="model_required")
    return APIError(404, f"The model '{name}' does not exist (GET /v1/models lists the models served)",
                    param="model", code="model_not_found")


class ModelSet:
    def __init__(self, settings: Settings, specs: list[ModelSpec], persistence: Persistence | None = None) -> None:
        self.settings = settings
        self.models = [ServedModel(spec, keep_alive=self._default_keep_alive(spec)) for spec in specs]
        self._by_name = {name: m for m in self.models for name in m.spec.names}
        self.single = not settings.many_models
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None
        self._peeks: asyncio.Task | None = None
        self.budget = int(settings.models_mb * MIB) if settings.models_mb else machine_bytes() - 1024 * MIB
        # each loaded model's prefix cache gets an equal share of the one host budget
        self.cache_mb = settings.prefix_state_mb / (1 if self.single else settings.models_max)
        self.draining = False  # set as the server drains: no load starts from then
        self._opened = persistence  # opened by the caller (python -m kvserve, to refuse a busy folder cleanly)
        self.persistence = Persistence()  # what start opened, or the caller's

    def _default_keep_alive(self, spec: ModelSpec) -> float:
        if spec.keep_alive is not None:
            return spec.keep_alive
        return keep_alive_seconds(self.settings.keep_alive)

    # -- names -------------------------------------------------------------------------------------
    def find(self, name: str | None) -> ServedModel:
        """The model a request's `model` names: any name with one model (`--model` alone), else a
        model's name, alias or LoRA adapter. 404 (400 without a name) otherwise."""
        if self.single:
            return self.models[0]
        found = self._by_name.get(name) if name is not None else None
        if found is None:
            raise not_found(name)
        return found

    @property
    def only(self) -> Engine:
        """The engine of the one model served by `--model` alone."""
        assert self.single and self.models[0].engine is not None
        return self.models[0].engine

    @property
    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models if m.engine is not None]

    @property
    def serving(self) -> bool:
        """At least one model serves, or (several models) the server can load them on demand."""
        engines = [m.engine for m in self.loaded]
        return any(e.async_engine.running for e in engines) or (not self.single and bool(self.models))

    # -- leases ------------------------------------------------------------------------------------
    async def lease(self, name: str | None, *, keep_alive: object = None, generate: bool = False) -> Lease:
        """The loaded engine of `name`'s model, held until the lease is released: loads it if need be.
        `keep_alive` (Ollama's) sets how long it stays loaded once idle; `generate`: 400 for an embedder."""
        model = self.find(name)
        if keep_alive is not None:
            try:
                model.keep_alive = keep_alive_seconds(keep_alive)
            except ValueError as exc:
                raise APIError(400, str(exc), param="keep_alive") from None
        model.leases += 1
        lease = None
        try:
            if generate and model.engine is None and await self._kind(model) == "embedding":
                raise _not_for_generation(model)  # before a load that could unload another model
            engine = model.engine or await self._wait_loaded(model)
            if generate and engine.kind == "embedding":
                raise _not_for_generation(model)
            lease = Lease(model, engine)
            return lease
        finally:
            if lease is None:
                model.leases -= 1
            model.last_used = time.monotonic()

    def probe(self, name: str | None) -> Lease | None:
        """`name`'s engine while it is loaded, held as `lease` holds it, for a look that is no use of
        it: nothing loads for it, and its keep-alive runs on. None where it is not loaded."""
        model = self.find(name)
        if model.engine is None:
            return None
        model.leases += 1
        return Lease(model, model.engine, used=False)

    async def _kind(self, model: ServedModel) -> str | None:
        """`chat` or `embedding`, read from the model's file as it is now (once per file); None where
        llama.cpp cannot read it."""
        file = _file_id(model)
        if model.kind is None or model.kind_file != file:
            model.kind, model.kind_file = await asyncio.to_thread(peek_kind, model.spec.settings.model), file
        return model.kind

    async def _wait_loaded(self, model: ServedModel) -> Engine:
        timeout = self.settings.queue_timeout or None
        try:
            return await asyncio.wait_for(asyncio.shield(self._load_task(model)), timeout)
        except asyncio.TimeoutError:
            raise APIError(503, f"model '{model.spec.name}' did not load within --queue-timeout "
                                f"({self.settings.queue_timeout:g} s)", type="server_error",
                           code="model_loading") from None

    def _load_task(self, model: ServedModel) -> asyncio.Task:
        if model.loading is None:
            model.loading = asyncio.ensure_future(self._load(model))
            # its waiters hear of a failure; one that no request waits for any more is not an error to log
            model.loading.add_done_callback(lambda task: task.cancelled() or task.exception())
        return model.loading

    # -- loading and unloading ---------------------------------------------------------------------
    async def _load(self, model: ServedModel) -> Engine:
        try:
            async with self._lock:
                if model.engine is not None:
                    return model.engine
                if self.draining:
                    raise shutting_down()
                self._check_file(model)
                if not self.single and await self._kind(model) is None:  # before unloading another for it
                    self._fail(model, "llama.cpp cannot read the file")
                await self._make_room(model, model.footprint or _file_bytes(model))
                engine = await self._open(model)
                try:  # room for its real footprint, before any request can lease it
                    await self._make_room(model, model.footprint)
                except BaseException:
                    await self._stop(model, engine)
                    raise
                model.engine, model.error, model.failed_file = engine, None, None
                model.last_used = time.monotonic()
                return engine
        finally:
            model.loading = None

    def _check_file(self, model: ServedModel) -> None:
        if model.error is not None and model.failed_file == _file_id(model):
            raise _load_failed(model)

    def _fail(self, model: ServedModel, error: str) -> None:
        """Record why `model` did not load (answered until its file changes), and raise that."""
        model.error, model.failed_file = error, _file_id(model)
        _log.error("model %s failed to load: %s", model.spec.name, model.error)
        raise _load_failed(model) from None

    async def _open(self, model: ServedModel) -> Engine:
        name = model.spec.name
        _log.info("loading model %s from %s", name, model.spec.settings.model)
        file = _file_id(model)
        kept = self._kept_for(model)
        try:
            tiers = self.persistence.tiers(name, model.spec.settings.page_rows)
            engine = await _on_a_thread_of_its_own(Engine.load, model.spec.settings, self.settings, self.cache_mb, kept, tiers)
        except Exception as exc:  # whatever a file makes llama.cpp or the engine refuse fails that model alone
            if kept is not None:
                kept.release()
            self._fail(model, str(exc) or type(exc).__name__)
        engine.async_engine.start()
        model.loaded_file = file if _file_id(model) == file else None  # replaced as it loaded: whose rows?
        model.footprint = engine.memory_bytes
        _log.info("model %s loaded (%s, %.0f MiB)", name, engine.kind, model.footprint / MIB)
        return engine

    async def _make_room(self, model: ServedModel, need: int) -> None:
        """Unload idle models, least recently used first, until `model` (not loaded, needing `need`
        bytes) fits; while only busy unpinned models could go, wait for one to finish, up to
        --queue-timeout. Where it would not fit with every unpinned model gone, none is unloaded."""
        timeout = self.settings.queue_timeout
        deadline = time.monotonic() + timeout if timeout else float("inf")
        while True:
            self._measure()
            others = [m for m in self.loaded if m is not model]
            if self._fits(others, need):
                return
            pinned = [m for m in others if m.spec.pinned]
            if not self._fits(pinned, need):
                raise self._no_room(model, pinned, need, "even with every unpinned model unloaded")
            idle = sorted((m for m in others if m.evictable), key=lambda m: m.last_used)
            if not idle and time.monotonic() < deadline:  # every other unpinned one is in use
                if self.draining:
                    raise shutting_down()
                await asyncio.sleep(0.05)  # a lease ends with its response's last byte
                continue
            if not idle:
                raise self._no_room(model, others, need, "none of the others became idle within --queue-timeout")
            await self._close(idle[0])

    def _measure(self) -> None:
        """Each loaded model's footprint as it is now: an embedding context made since its load counts too."""
        for m in self.loaded:
            m.footprint = m.engine.memory_bytes

    def _used(self, loaded: list[ServedModel], need: int) -> int:
        return sum(m.footprint for m in loaded) + need + int(self.settings.prefix_state_mb * MIB)

    def _fits(self, loaded: list[ServedModel], need: int) -> bool:
        """Whether a model needing `need` bytes fits beside `loaded`."""
        return len(loaded) + 1 <= self.settings.models_max and (self.single or self._used(loaded, need) <= self.budget)

    def _no_room(self, model: ServedModel, loaded: list[ServedModel], need: int, why: str) -> APIError:
        if len(loaded) + 1 > self.settings.models_max:
            says = (f"cannot load model '{model.spec.name}': {len(loaded)} models are loaded (--models-max "
                    f"{self.settings.models_max}), {why}")
        else:
            says = (f"cannot load model '{model.spec.name}': it needs {self._used(loaded, need) / MIB:.1f} MiB with "
                    f"the models loaded and the prefix cache, over --models-mb {self.budget / MIB:.1f}, {why}")
        return APIError(503, says, type="server_error", code="model_no_room")

    async def unload(self, name: str) -> bool:
        """Unload `name`'s model now (POST /models/unload): False when it is not loaded; a 409 while in use."""
        model = self.find(name)
        async with self._lock:
            if model.engine is None:
                return False
            if model.leases:
                raise APIError(409, f"model '{model.spec.name}' is serving {model.leases} requests", code="model_busy")
            await self._close(model)
            return True

    async def load(self, name: str) -> ServedModel:
        """Load `name`'s model now (POST /models/load, or `load_at_start`)."""
        model = self.find(name)
        if model.engine is None:
            await self._wait_loaded(model)
        return model

    def _kept_for(self, model: ServedModel) -> PrefixCache | None:
        """`model`'s kept cache where its file is unchanged (released otherwise), after releasing the
        least recently used other kept caches until this load's cache fits `--models-max` caches."""
        kept, model.kept = model.kept, None
        if kept is not None and model.loaded_file != _file_id(model):
            kept.release()
            kept = None
        if not model.caches:
            return kept
        others = sorted((m for m in self.models if m.kept is not None and m is not model), key=lambda m: m.last_used)
        while others and sum(m.caches for m in self.loaded) + len(others) + 1 > self.settings.models_max:
            others.pop(0).release_kept()
        return kept

    async def _close(self, model: ServedModel) -> None:
        engine, model.engine = model.engine, None
        if engine is not None:
            await self._stop(model, engine)

    async def _stop(self, model: ServedModel, engine: Engine) -> None:
        """Unload `engine`, `model`'s, keeping its cache for the model's next load."""
        _log.info("unloading model %s", model.spec.name)
        await engine.async_engine.stop()
        model.kept = await asyncio.to_thread(engine.close, True)

    # -- lifetime ----------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the models marked `load_at_start` (`--model` alone: its model; a failure there stops the
        server, as ever), then unload idle ones past their keep-alive, every second. The disk tier and
        the event publisher open first: another server on the same folder stops this one here."""
        names = [model.spec.name for model in self.models]
        self.persistence = self._opened or await asyncio.to_thread(Persistence.open, self.settings, names)
        for model in self.models:
            if model.spec.load_at_start:
                try:
                    await self._load_task(model)  # no request waits on it: --queue-timeout does not bound it
                except APIError as exc:
                    if self.single:
                        raise RuntimeError(model.error or str(exc)) from None
        self._reaper = asyncio.create_task(self._reap())
        if not self.single:
            self._peeks = asyncio.create_task(self._peek_kinds())

    async def _peek_kinds(self) -> None:
        """Each model's kind from its file, in the background, so /v1/models can say it before a load."""
        for model in self.models:
            await self._kind(model)

    async def _reap(self) -> None:
        """Each second: unload the models idle past their keep-alive, then idle ones while the loaded
        ones' footprints pass --models-mb (a chat model's embedding context, made by its first
        /v1/embeddings request, is not in the footprint its load made room for)."""
        while True:
            await asyncio.sleep(1.0)
            for model in self.models:
                if model.expired(time.monotonic()):
                    async with self._lock:
                        if model.expired(time.monotonic()):
                            await self._reaped(model)
            if self._over_budget():
                async with self._lock:
                    while self._over_budget() and (idle := [m for m in self.loaded if m.evictable]):
                        await self._reaped(min(idle, key=lambda m: m.last_used))

    async def _reaped(self, model: ServedModel) -> None:
        try:
            await self._close(model)
        except Exception:
            _log.exception("unloading model %s failed", model.spec.name)

    def _over_budget(self) -> bool:
        if self.single:
            return False
        self._measure()
        return self._used(self.loaded, 0) > self.budget

    async def close(self) -> None:
        for task in (self._reaper, self._peeks):
            if task is not None:
                task.cancel()
        async with self._lock:
            for model in self.models:
                await self._close(model)
            if not await asyncio.to_thread(self.persistence.flush, CLOSE_WAIT_S):
                _log.warning("disk tier: writes still queued after %gs; pages past its queue are lost", CLOSE_WAIT_S)
            for model in self.models:
                model.release_kept()
        await asyncio.to_thread(self.persistence.close)

    def describe(self, model: ServedModel) -> dict:
        """One model as GET /v1/models lists it, beside OpenAI's fields."""
        engine = model.engine
        out = {"id": model.spec.name, "status": {"value": model.status.value}, "aliases": list(model.spec.aliases),
               "pinned": model.spec.pinned, "path": str(model.spec.settings.model)}
        if engine is not None:
            model.kind, model.kind_file = engine.kind, model.loaded_file
            out.update(max_model_len=engine.max_seq_len, memory_mb=round(model.footprint / MIB, 1))
        if model.kind is not None:
            out["kind"] = model.kind
        if model.error is not None:
            out["status"]["failed"] = True
            out["error"] = model.error
        return out


def _not_for_generation(model: ServedModel) -> APIError:
    return APIError(400, f"model '{model.spec.name}' is an embedding model: it serves /v1/embeddings only",
                    param="model", code="model_not_supported")


def _load_failed(model: ServedModel) -> APIError:
    return APIError(503, f"model '{model.spec.name}' cannot be loaded: {model.error}", type="server_error",
                    code="model_load_failed")


def _file_id(model: ServedModel) -> FileId | None:
    try:
        target = Path(model.spec.settings.model).resolve()
        st = target.stat()
    except (OSError, TypeError, RuntimeError):
        return None
    return str(target), st.st_ino, st.st_size, st.st_mtime_ns


def _file_bytes(model: ServedModel) -> int:
    found = _file_id(model)
    return found[2] if found else 0


class ReleaseLeases:
    """Ends the model leases a request took once its response is sent, a streamed one to its last chunk."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            for lease in scope.get("state", {}).get("model_leases", ()):
                lease.release()


async def engine_for(request: Request, name: str | None, *, keep_alive: object = None, generate: bool = False) -> Engine:
    """The engine serving `name` for this request, held until its response is sent (`ReleaseLeases`)."""
    return _held(request, await request.app.state.models.lease(name, keep_alive=keep_alive, generate=generate))


def loaded_engine_for(request: Request, name: str | None) -> Engine | None:
    """`name`'s engine where it is loaded, held as `engine_for` holds it (`ModelSet.probe`), else None."""
    lease = request.app.state.models.probe(name)
    return None if lease is None else _held(request, lease)


def _held(request: Request, lease: Lease) -> Engine:
    leases = getattr(request.state, "model_leases", None)
    if leases is None:
        leases = request.state.model_leases = []
    leases.append(lease)
    return lease.engine


async def _on_a_thread_of_its_own(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a thread that ends when it returns. llama.cpp's CPU workers (OpenMP's) belong to
    the thread that decodes and live as long as it does. A load decodes (the flash-attention check;
    the disk tier learning the state layout), and on a thread that outlived it (asyncio.to_thread's)
    its workers stayed beside the engine's: OpenMP then spins each worker far less at a barrier, and
    every step decoded slower (the 1.5B at 2,048 tokens: 57 ms a token, against 46 from one set)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="kvserve-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
    finally:
        executor.shutdown(wait=False)
