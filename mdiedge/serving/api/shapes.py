"""What a completion request makes of its runs' samples: with ``best_of``, the ``n`` likeliest
of the samples drawn per prompt (the highest mean log-probability per token, as OpenAI ranks
them); with ``echo``, each choice's text after its prompt's; the usage of all runs together
(every sample drawn counts, as OpenAI bills ``best_of``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Sequence

from .responses import Usage
from .schema import Options


@dataclass
class Shape:
    options: Options  # the request's, as asked
    echo: bool = False
    best_of: int = 1  # samples drawn per prompt (``n`` of them returned)

    @property
    def asked_logprobs(self) -> bool:
        """The client asked for logprobs (ranking draws them anyway)."""
        return self.options.top_logprobs is not None

    @property
    def ranks(self) -> bool:
        return self.best_of > self.options.n

    def drawing(self, options: Options) -> Options:
        """The options each run draws its samples with: ``best_of`` of them, each token's
        log-probability kept (what ranking reads)."""
        if not self.ranks:
            return options
        params = options.asked.params
        if params.top_logprobs is None:
            params = dataclasses.replace(params, top_logprobs=0)
        return dataclasses.replace(options, asked=dataclasses.replace(
            options.asked, n_samples=self.best_of, params=params))

    def kept(self, samples: Sequence[Any]) -> List[Any]:
        """The samples a run answers with: all, or the ``n`` likeliest, best first."""
        if not self.ranks:
            return list(samples)
        return sorted(samples, key=mean_logprob, reverse=True)[:self.options.n]

    def echoed(self, run: Any) -> str:
        """The text a choice of ``run`` starts with: its prompt's, when echoed."""
        if not self.echo:
            return ""
        return run.prompt_text


def mean_logprob(sample: Any) -> float:
    """A sample's mean log-probability per token (its end token's not counted: it has none)."""
    scored = [s.logprob for s in sample.logprobs]
    return sum(scored) / len(scored) if scored else float("-inf")


def total_usage(runs: Sequence[Any]) -> Usage:
    usages = [run.usage() for run in runs]
    return Usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in usages))
