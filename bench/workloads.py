"""The workloads every suite sends: users that each send `rounds` streamed chat requests, one after
another, all users at once. A workload is only the messages; the suite picks output length and
extra body fields."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from bench.client import Result, stream_chat

# (user, round, the user's earlier answers) -> the chat messages of that request
Messages = Callable[[int, int, list[str]], list[dict]]


@dataclass(frozen=True)
class Workload:
    name: str
    users: int
    rounds: int
    messages: Messages
    # None: every user at once, each sending its rounds in a row. A number: that many requests in
    # flight, turn by turn: every user's round r goes before any user's round r + 1, so each user
    # comes back only after all the others were served.
    at_once: int | None = None


@dataclass
class Run:
    per_user: list[list[Result]]
    wall: float  # seconds from the first request sent to the last answer received

    @property
    def results(self) -> list[Result]:
        return [r for rounds in self.per_user for r in rounds]


def system_prompt(words: int = 700) -> str:
    """~1,200 tokens of varied text (a policy handbook), the same for every user."""
    topics = ["billing", "shipping", "returns", "warranty", "privacy", "accounts", "security", "support"]
    lines = [f"Section {i}: the {topics[i % 8]} policy, clause {i * 7 % 13}, applies to case {i}."
             for i in range(words // 12)]
    return "You are the support assistant of Example Corp. Follow this handbook.\n" + "\n".join(lines)


def shared(users: int = 8, rounds: int = 4) -> Workload:
    """One system prompt for everyone, a distinct question per request."""
    system = system_prompt()
    return Workload("shared", users, rounds, lambda u, r, _: [
        {"role": "system", "content": system},
        {"role": "user", "content": f"User {u}, question {r}: which clause covers case {u * 3 + r}?"}])


def multiturn(users: int = 8, rounds: int = 4) -> Workload:
    """Conversations on one system prompt; each turn carries the earlier questions and answers."""
    system = system_prompt()

    def question(u: int, t: int) -> dict:
        return {"role": "user", "content": f"Customer {u}, turn {t}: where is parcel {u * 10 + t}?"}

    def messages(u: int, r: int, answers: list[str]) -> list[dict]:
        history = [m for t, answer in enumerate(answers)
                   for m in (question(u, t), {"role": "assistant", "content": answer})]
        return [{"role": "system", "content": system}, *history, question(u, r)]

    return Workload("multiturn", users, rounds, messages)


def conversations(users: int = 32, rounds: int = 3, at_once: int = 8, words: int = 300) -> Workload:
    """A chat application's traffic: one system prompt for everyone, each conversation its own pasted
    document (~`words` words, ~400 tokens) and questions about it; conversations come back in turn."""
    system = system_prompt()
    subjects = ["harbour", "orchard", "library", "foundry", "observatory", "vineyard", "railway", "mill"]

    def document(u: int) -> str:
        sentences = [f"Note {i} of file {u}: the {subjects[(u + i) % 8]} logged {(u * 53 + i * 29) % 1009} "
                     f"items on day {(i * 7 + u) % 31}." for i in range(words // 15)]
        return " ".join(sentences)

    def question(u: int, t: int) -> dict:
        text = f"In file {u}, what was logged on day {(t * 11 + u) % 31}?"
        return {"role": "user", "content": f"Here is my file:\n{document(u)}\n\n{text}" if t == 0 else text}

    def messages(u: int, r: int, answers: list[str]) -> list[dict]:
        history = [m for t, answer in enumerate(answers)
                   for m in (question(u, t), {"role": "assistant", "content": answer})]
        return [{"role": "system", "content": system}, *history, question(u, r)]

    return Workload("conversations", users, rounds, messages, at_once)


def unique(salt: str, users: int = 8, rounds: int = 2, sentences: int = 40) -> Workload:
    """Prompts of `sentences` sentences (12 to 16 tokens each, by salt: 40 make ~490 to 650 tokens)
    that share nothing with each other, nor with another salt's."""
    return Workload("unique", users, rounds, lambda u, r, _: [
        {"role": "user", "content": f"{salt} story {u}-{r}: "
         + f"a tale of the number {u * 31 + r} and its {salt} friends. " * sentences}])


def long(salt: str, users: int = 2, rounds: int = 1, lines: int = 114) -> Workload:
    """~3,000-token prompts (a ledger to summarize), distinct from the first token on."""
    def messages(u: int, r: int, _: list[str]) -> list[dict]:
        body = "\n".join(f"Entry {i}: account {u}-{r}-{i} moved {(i * 37 + u * 11 + r) % 997} units to "
                         f"{salt} depot {i % 17}." for i in range(lines))
        return [{"role": "user", "content": f"Ledger {u}-{r} of {salt}. Summarize it.\n{body}"}]

    return Workload("long", users, rounds, messages)


async def run(url: str, workload: Workload, max_tokens: int, extra: dict | None = None) -> Run:
    """Each user sends its rounds one after another, keeping its answers: all users at once, or
    `workload.at_once` requests at a time, turn by turn."""
    if workload.at_once is not None:
        return await _run_in_turns(url, workload, max_tokens, extra)
    # a fresh connection per request: a pooled one the server has timed out fails the request
    # (llama-server closes idle keep-alive connections after a few seconds), and on loopback
    # connecting costs nothing next to a request
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        async def user(u: int) -> list[Result]:
            results: list[Result] = []
            for r in range(workload.rounds):
                messages = workload.messages(u, r, [x.text for x in results])
                results.append(await stream_chat(client, url, messages, max_tokens, extra))
            return results

        started = time.perf_counter()
        per_user = await asyncio.gather(*(user(u) for u in range(workload.users)))
        return Run(list(per_user), time.perf_counter() - started)


def run_sync(url: str, workload: Workload, max_tokens: int, extra: dict | None = None) -> Run:
    return asyncio.run(run(url, workload, max_tokens, extra))


async def _run_in_turns(url: str, workload: Workload, max_tokens: int, extra: dict | None) -> Run:
    """`at_once` workers take (user, round) in turn order; a user's round waits for its previous one."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
    order = iter([(u, r) for r in range(workload.rounds) for u in range(workload.users)])
    per_user: list[list[Result]] = [[] for _ in range(workload.users)]
    done = {(u, r): asyncio.Event() for u in range(workload.users) for r in range(workload.rounds)}
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker() -> None:
            for u, r in order:
                if r:
                    await done[u, r - 1].wait()
                messages = workload.messages(u, r, [x.text for x in per_user[u]])
                per_user[u].append(await stream_chat(client, url, messages, max_tokens, extra))
                done[u, r].set()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workload.at_once)))
        return Run(per_user, time.perf_counter() - started)
