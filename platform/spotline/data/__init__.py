"""Training text: a corpus that needs no network, and a resumable sampler."""

from spotline.data.corpus import CorpusError, load_corpus
from spotline.data.sampler import Sampler

__all__ = ["CorpusError", "Sampler", "load_corpus"]
