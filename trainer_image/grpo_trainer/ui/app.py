"""The `grpo ui` web app (Starlette, Jinja2 templates, uPlot charts): read-only pages over a
RunView. Every route is a GET; nothing writes to the run.

  /                    the run: its curves and its steps
  /step/N              step N's prompts and their groups of responses, with the filters
  /prompt/KEY          one prompt (its dataset index) across a window of steps, with the filters
  /image/SHA256        a VL prompt's image, from the run's images/ (the name its records give it)
"""

from __future__ import annotations

import math
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from grpo_api.images import image_kind
from grpo_trainer.ui.run_view import GROUPS_PER_PAGE, PROMPT_WINDOW, RunView, ViewFilters

HERE = Path(__file__).parent


def build_app(view: RunView) -> Starlette:
    templates = Jinja2Templates(directory=str(HERE / "templates"))
    templates.env.filters["shade"] = shade
    root = view.history.layout.root

    def run_page(request: Request):
        metrics = view.metrics()
        return templates.TemplateResponse(request, "run.html", {
            "root": root, "panels": view.curves(metrics), "steps": view.steps(metrics), "deleted": view.deleted_note()})

    def step_page(request: Request):
        step = request.path_params["step"]
        filters = _filters(request)
        try:
            groups = view.step_groups(step)
        except LookupError as exc:
            raise HTTPException(404, str(exc)) from None
        shown = _filtered(groups, filters)
        page = _int(request, "page", 1)
        pages = max(1, math.ceil(len(shown) / GROUPS_PER_PAGE))
        on_page = shown[(page - 1) * GROUPS_PER_PAGE:page * GROUPS_PER_PAGE]
        view.tokenize(on_page)
        steps = [s for s in view.rollout_steps() if s != step]
        return templates.TemplateResponse(request, "step.html", {
            "root": root, "step": step, "groups": on_page,
            "page": page, "pages": pages, "filters": filters, "sources": _sources(groups),
            "total": sum(len(g.samples) for g in groups), "shown": sum(len(g.samples) for g in shown),
            "total_groups": len(groups), "shown_groups": len(shown), "estimator": view.algorithm[0],
            "previous": max((s for s in steps if s < step), default=None),
            "next": min((s for s in steps if s > step), default=None), "query": _query(request)})

    def prompt_page(request: Request):
        key = request.path_params["key"]
        if not (key.isascii() and key.isdigit() and key == str(int(key))):
            raise HTTPException(404, f"prompt {key!r}: not a prompt; a prompt is its dataset row number, as "
                                     "in /prompt/12 (each group's \"this prompt across steps\" link)")
        filters = _filters(request)
        stored = view.rollout_steps()
        last = _int(request, "last", stored[-1] if stored else 0)
        first = _int(request, "first", max(1, last - PROMPT_WINDOW + 1))
        groups = _filtered(view.prompt_across_steps(key, first, last), filters, keep_empty=True)
        view.tokenize(groups)
        return templates.TemplateResponse(request, "prompt.html", {
            "root": root, "key": key, "groups": groups, "first": first, "last": last, "filters": filters,
            "sources": _sources(groups), "estimator": view.algorithm[0], "deleted": view.deleted_note(),
            "reward_chart": {"title": "Reward of this prompt's responses", "steps": [g.step for g in groups],
                      "series": {"mean": [g.reward_mean if g.samples else None for g in groups],
                                 "max": [max((s.reward for s in g.samples), default=None) for g in groups]}},
            "window": PROMPT_WINDOW, "query": _query(request)})

    def image(request: Request):
        try:
            data = view.image(request.path_params["name"])
        except LookupError as exc:
            raise HTTPException(404, str(exc)) from None
        # Named by its hash, an image never changes; nosniff: a stored file is never run as a page.
        return Response(data, media_type=image_kind(data)[0],
                        headers={"Cache-Control": "max-age=31536000, immutable", "X-Content-Type-Options": "nosniff"})

    routes = [Route("/", run_page), Route("/step/{step:int}", step_page), Route("/prompt/{key}", prompt_page),
              Route("/image/{name}", image),
              Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")]
    return Starlette(routes=routes)


def shade(logprob: float | None) -> str:
    """A token's background: the less likely the behaviour policy found it, the redder; a tool's
    token (no log-prob) grey."""
    if logprob is None:
        return "background: #e4e4e4"
    surprise = 1.0 - math.exp(max(logprob, -50.0))
    return f"background: rgba(220, 40, 40, {0.75 * surprise:.2f})"


def _filters(request: Request) -> ViewFilters:
    q = request.query_params
    try:
        return ViewFilters(min_reward=_float(q.get("min_reward")), max_reward=_float(q.get("max_reward")),
                           data_source=q.get("data_source") or None, text=q.get("q") or None)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def _float(text: str | None) -> float | None:
    if text is None or not text.strip():
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


def _int(request: Request, name: str, default: int) -> int:
    text = request.query_params.get(name)
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise HTTPException(400, f"{name}: not an integer: {text!r}") from None


def _filtered(groups, filters: ViewFilters, keep_empty: bool = False):
    """The groups with only their samples that pass; groups left with none are dropped (kept
    empty on the prompt page, where a step with no match still says so)."""
    from dataclasses import replace
    out = []
    for g in groups:
        samples = [s for s in g.samples if filters.passes(s, g.prompt_text)]
        if samples or keep_empty:
            out.append(replace(g, samples=samples))
    return out


def _sources(groups) -> list[str]:
    return sorted({g.data_source for g in groups if g.data_source})


def _query(request: Request) -> str:
    """The filters' query string, for links that keep them (without the page number)."""
    from urllib.parse import urlencode
    return urlencode([(k, v) for k, v in request.query_params.multi_items() if k not in ("page", "first", "last")])
