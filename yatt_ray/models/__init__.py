"""The embedded default: a tiny Llama-architecture model and a character tokenizer, built locally."""

from yatt_ray.models.tiny import TinyModelSpec, build_tiny_model, build_tokenizer

__all__ = ["TinyModelSpec", "build_tiny_model", "build_tokenizer"]
