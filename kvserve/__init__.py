"""kvserve: an OpenAI-compatible server over llama.cpp with continuous batching and a prefix cache."""

__version__ = "0.1.0"
