"""Drive kvserve's prefix cache by hand on SmolLM2: the shape of building one's own scheduler.

Stream A prefills a ~60-token system prompt plus its question and donates its pages (its rows,
copied into host memory); the cache says how much of stream B it already holds; B attaches those
pages (the rows set into its own KV stream) and prefills only its tail. Then, given a model that carries state (a hybrid such as LFM2), the same
with a checkpoint at the system opening, restored by a second conversation.
Run: python examples/prefix_cache_by_hand.py [HYBRID.gguf]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kvserve.cache import (
    MarkKind, PrefixKey, add_user, create_chat_renderer, create_kv_pool, render_turn_marked,
)
from kvserve.scheduler.kv_manager import KvManager
from kvserve.config import embedded_model_path
from kvserve.llama.chat_template import ChatTemplate
from kvserve.llama.model import Model

SYSTEM = (
    "You are Atlas, a geography tutor. Answer in one short sentence, name the country and the "
    "continent, and never invent facts. If a question is not about geography, say so politely. "
    "Prefer well-known cities and keep a friendly tone."
)


def chat_tokens(model: Model, template: ChatTemplate, question: str) -> list[int]:
    text = template.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    return model.tokenize(text, add_special=model.adds_bos, parse_special=True)


def greedy_reply(kv: KvManager, session, logits: np.ndarray, model: Model, n: int = 24) -> str:
    out: list[int] = []
    for _ in range(n):
        token = int(np.argmax(logits))
        if model.is_eog(token):
            break
        out.append(token)
        logits = kv.eval(session, [token])
    return model.detokenize(out)


def pages() -> None:
    model = Model(embedded_model_path())
    template = ChatTemplate.from_model(model)
    pool, cache = create_kv_pool(model, page_rows=16, n_ctx_seq=1024, n_streams=2)
    kv = KvManager(pool, cache)

    prompt_a = chat_tokens(model, template, "Where is Lyon?")
    prompt_b = chat_tokens(model, template, "Where is Kyoto?")
    print(f"system prompt + question: A has {len(prompt_a)} tokens, B has {len(prompt_b)}")

    a = kv.new_session()
    reply_a = greedy_reply(kv, a, kv.eval(a, prompt_a), model)
    print(f"A prefilled {len(prompt_a)} tokens and answered: {reply_a!r}")
    chain = cache.insert(a, a.tokens, preview="Where is Lyon?")
    print(f"A donated {len(a.tokens)} evaluated tokens as chain {chain.id}: {cache.stats().held_pages} full pages")

    key_b = PrefixKey("", prompt_b)  # "": the shared namespace (a tenant's would keep B's rows its own)
    print(f"the cache holds {cache.match_len(key_b)} of B's {len(prompt_b)} leading tokens")
    b = kv.new_session()
    attached = kv.attach(b, key_b)
    tail = prompt_b[attached:]
    reply_b = greedy_reply(kv, b, kv.eval(b, tail), model)
    print(f"B attached {attached} tokens, prefilled only {len(tail)}, and answered: {reply_b!r}")

    for entry in cache.view("")["chains"]:
        print("chain", entry)
    print(f"held pages: {cache.stats().held_pages} ({cache.bytes_used} bytes of host memory), "
          f"KV cells in use: {pool.used_cells} of {pool.n_cells}")

    # Teardown, in order: sessions first (they lock pages), then the cache, then the pool.
    pool.end_session(a)
    pool.end_session(b)
    cache.release()
    pool.close()
    model.close()
    print("released: sessions, cache, pool, model")


def checkpoints(model_path: Path) -> None:
    model = Model(model_path)
    pool, cache = create_kv_pool(model, page_rows=16, n_ctx_seq=1024, n_streams=2, max_states=4,
                                 budget_bytes=1 << 20)
    kv = KvManager(pool, cache)

    chat_a = create_chat_renderer(model, SYSTEM)
    add_user(chat_a, "Where is Lyon?")
    turn_a = render_turn_marked(model, chat_a)
    print(f"hybrid: A has {len(turn_a.tokens)} tokens; marks head={turn_a.head} opening={turn_a.opening} "
          f"close={turn_a.close}")
    a = kv.new_session()
    stop = cache.checkpoint_at(a, turn_a.tokens, 0, turn_a.opening)
    kv.eval(a, turn_a.tokens[:stop])  # a recurrent state cannot be cut back: stop the prefill here
    checkpoint = cache.insert(a, a.tokens, kind=MarkKind.OPENING)
    print(f"A stopped its prefill at {stop} and saved a {checkpoint.nbytes}-byte state there")
    kv.eval(a, turn_a.tokens[stop:])

    chat_b = create_chat_renderer(model, SYSTEM)
    add_user(chat_b, "Where is Kyoto?")
    turn_b = render_turn_marked(model, chat_b)
    b = kv.new_session()
    restored = kv.attach(b, PrefixKey("", turn_b.tokens))
    kv.eval(b, turn_b.tokens[restored:])
    print(f"B restored the checkpoint at {restored} and prefilled only {len(turn_b.tokens) - restored} tokens")
    print("checkpoints", cache.view("")["checkpoints"])

    pool.end_session(a)
    pool.end_session(b)
    cache.release()
    pool.close()
    model.close()


if __name__ == "__main__":
    pages()
    if len(sys.argv) > 1:
        checkpoints(Path(sys.argv[1]))
    else:
        print("checkpoints: pass the path of a hybrid GGUF (an LFM2, for one) to see them too")
