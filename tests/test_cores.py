"""Engines of several models share the threads: one alone gets all of its own, two with work at
once split them, and the threads of the steps running at once never exceed the budget."""

from __future__ import annotations

import threading
import time

from kvserve.scheduler.cores import Cores


def test_an_engine_alone_gets_all_its_threads() -> None:
    cores = Cores()
    with cores.share("chat", 4, lambda: True) as n:
        assert n == 4
    with cores.share("chat", 4, lambda: False) as n:
        assert n == 4


def test_engines_with_work_at_once_split_the_threads_and_never_exceed_them() -> None:
    cores = Cores()
    running, most, seen = [0], [0], {"chat": set(), "embed": set()}
    lock = threading.Lock()
    left = {"chat": 30, "embed": 30}

    def engine(name: str) -> None:
        while left[name]:
            with cores.share(name, 2, lambda: left[name] > 1) as n:
                with lock:
                    running[0] += n
                    most[0] = max(most[0], running[0])
                seen[name].add(n)
                time.sleep(0.002)
                with lock:
                    running[0] -= n
            left[name] -= 1

    threads = [threading.Thread(target=engine, args=(name,)) for name in left]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert most[0] <= 2  # never more threads than the cores they share
    assert 1 in seen["chat"] and 1 in seen["embed"]  # both had work at once: a thread each


def test_an_engine_that_left_no_longer_takes_a_share() -> None:
    cores = Cores()
    with cores.share("embed", 2, lambda: True):
        pass  # it still has work: counted
    cores.leave("embed")  # unloaded
    with cores.share("chat", 2, lambda: True) as n:
        assert n == 2


def test_an_engine_is_alone_until_another_starts_and_again_once_it_stops() -> None:
    cores = Cores()
    cores.join("chat")
    assert cores.alone("chat")
    cores.join("embed")
    assert not cores.alone("chat") and not cores.alone("embed")
    cores.leave("embed")
    assert cores.alone("chat")
