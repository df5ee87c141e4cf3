"""`RwkvxLM`: an rwkvx model and its tokenizer as an lm-evaluation-harness language model.

Imports lm_eval at module level: import this module only after `harness.require_lm_eval()`.
"""

from __future__ import annotations

from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from rwkvx_cli.evaluation.scoring import greedy_until, score_continuations
from rwkvx_cli.models.model import LM

DEFAULT_MAX_GEN_TOKS = 256


class RwkvxLM(TemplateLM):
    """lm-eval's requests scored by our model: `loglikelihood` (TemplateLM tokenizes each pair,
    moving a context's trailing spaces to the continuation; we score the ids), `loglikelihood_rolling`
    (a whole document: one stateful pass for a pure recurrent model, else lm-eval's disjoint rolling
    windows of `max_length`) and `generate_until` (greedy). `on_progress(what, done, total, unit)` hears
    the requests done of each kind (the CLI's render.console.progress; none where lm-eval says disable_tqdm)."""

    def __init__(
        self, model: LM, tokenizer, max_length: int, batch_size: int = 16, mode: str = "fp32", on_progress=None
    ):
        super().__init__()
        self.on_progress = on_progress
        self.mode = mode  # the resolved train.precision the forwards run under
        self.model = model
        self.rwkvx_tokenizer = tokenizer  # not `tokenizer`: lm-eval reads that as a HuggingFace one
        self._max_length = max_length
        self.batch_size = batch_size

    @property
    def eot_token_id(self) -> int:
        return int(self.rwkvx_tokenizer.eod_id)

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return next(self.model.parameters()).device

    @property
    def tokenizer_name(self) -> str:
        return f"rwkvx-{self.rwkvx_tokenizer.kind}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.rwkvx_tokenizer.encode(string))

    def tok_decode(self, tokens) -> str:
        return self.rwkvx_tokenizer.decode(list(tokens))

    def _counter(self, what: str, total: int, disable: bool):
        """step(n): n more of `total` requests done, told to on_progress."""
        if self.on_progress is None or disable:
            return lambda n: None
        done = [0]
        self.on_progress(what, 0, total, "requests")

        def step(n: int) -> None:
            done[0] += n
            self.on_progress(what, done[0], total, "requests")

        return step

    def _score(self, pairs, desc: str, disable_tqdm: bool) -> list[tuple[float, bool]]:
        step = self._counter(desc, len(pairs), disable_tqdm)
        return score_continuations(self.model, pairs, self.batch_size, self.max_length, progress=step, mode=self.mode)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        todo = [i for i, (_, _, cont) in enumerate(requests) if cont]
        scores = self._score([(requests[i][1], requests[i][2]) for i in todo], "scoring", disable_tqdm)
        results = [(0.0, True)] * len(requests)  # an empty continuation: log 1, trivially greedy
        for i, res in zip(todo, scores, strict=True):
            results[i] = res
        for (key, _, _), res in zip(requests, results, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for n, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0])
            if not tokens:
                continue
            if self.model.recurrent:
                windows = [([self.eot_token_id], tokens)]
            else:
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(tokens, self.eot_token_id, self.max_length, context_len=1)
                ]
            pairs += windows
            owner += [n] * len(windows)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owner, self._score(pairs, "scoring documents", disable_tqdm), strict=True):
            totals[n] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results = []
        step = self._counter("generating (greedy)", len(requests), disable_tqdm)
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))

            def stop(ids, until=until):
                text = self.tok_decode(ids)
                return any(u in text for u in until)

            ids = greedy_until(
                self.model, self.tok_encode(context), max_new, self.max_length, stop, self.eot_token_id, self.mode
            )
            text = self.tok_decode(ids)
            for u in until:
                if u:
                    text = text.split(u)[0]
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            results.append(text)
            step(1)
        return results
