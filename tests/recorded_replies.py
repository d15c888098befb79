"""Replies recorded from real models, for the reply reader's every-byte-cut tests. Each names
its source; they are short on purpose. Texts end where generation ended (`<|call|>` and
`<|return|>` end a gpt-oss reply: the server never sees them as text, but a transcript may)."""

# gpt-oss, from openai/harmony, test-data/test_streamable_parser.txt (commit ec7606d): a real
# completion that thinks, then calls the builtin browser.search tool on the commentary channel.
# The file continues with the tool's answer, which is the next prompt's, not this reply's.
GPT_OSS_BROWSE = '<|channel|>analysis<|message|>User asks "Who is the current US president?" It\'s 2025, presumably current president is Joe Biden? Actually as of 2025-07-28, there was a 2024 election. In 2024, President is probably President Biden still? But w\ne need up to date info. Let\'s browse to confirm.<|end|><|start|>assistant<|channel|>commentary to=browser.search code<|message|>{"query": "current US president July 2025", "topn": 10, "source": "news"}<|call|>'

# gpt-oss, from openai/harmony, docs/format.md ("Receiving messages", "Function calling"): the
# reply to "What is 2 + 2?", and the reply that calls get_weather (the reply starts after the
# prompt's `<|start|>assistant`).
GPT_OSS_ANSWER = ("<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>")
GPT_OSS_CALL = ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                "{\"location\":\"San Francisco\"}<|call|>")
# The same doc's preamble ("Preambles"): a commentary message for the user, then a call whose
# header has no space before <|constrain|>. The doc elides the chain of thought as written here.
GPT_OSS_PREAMBLE = ("<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant"
                    "<|channel|>commentary<|message|>**Action plan**:\n1. Generate an HTML file\n"
                    "2. Generate a JavaScript for the Node.js server\n3. Start the server\n---\n"
                    "Will start executing the plan step by step<|end|><|start|>assistant<|channel|>commentary "
                    "to=functions.generate_file<|constrain|>json<|message|>"
                    "{\"template\": \"basic_html\", \"path\": \"index.html\"}<|call|>")

# DeepSeek-R1 (deepseek-reasoner), from opensolon/solon,
# solon-projects/solon-ai/solon-ai/src/test/java/features/ai/DeepSeek.md: a recorded API response to
# "hello", whose reasoning_content and content are put back in the raw form R1 writes them after
# its template's `<think>\n` (reasoning, `\n</think>\n\n`, answer).
R1_REASONING = ("Okay, the user wrote \"hello\". That's pretty straightforward. I should respond in a friendly "
                "and welcoming manner. Maybe say \"Hello! How can I assist you today?\" to prompt them to ask for "
                "help. Keep it open-ended so they feel comfortable to ask anything. Let me check for any typos and "
                "make sure the tone is right. Yep, that sounds good. Send it off.")
R1_ANSWER = "Hello! How can I assist you today?"
R1_HELLO = f"{R1_REASONING}\n</think>\n\n{R1_ANSWER}"
