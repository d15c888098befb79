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
    """All users at once; each sends its rounds one after another, keeping its answers."""
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
