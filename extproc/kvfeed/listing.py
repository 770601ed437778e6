"""Which names an inference server serves for each of its model pools, from its OpenAI model list.

Pure: the body of `GET /v1/models` and the pools the metrics page named in, names per pool out.

vLLM 0.32.0 (`vllm/entrypoints/openai/models/serving.py` `OpenAIServingModels.show_available_models`, cards
of `vllm/entrypoints/serve/engine/protocol.py` `ModelCard`) lists:

- one card per `--served-model-name` value (`vllm/entrypoints/launchers/api_server/app_state.py` builds one
  `BaseModelPath(name, model_path=args.model)` each), with `root` = the model path and `parent` null. Its
  metrics carry only the first of them (`model_name` label: `get_served_model_name` in
  `vllm/config/model.py`), which is the pool; the others are aliases of it, told by the same `root`.
- one card per loaded LoRA adapter, `id` = the adapter's name, `root` = its path, `parent` = its base
  model's served name (the first served name when the adapter names none). An adapter runs on its base
  model's weights and KV cache, so it belongs to its parent's pool.

A card that maps to no pool of the page (a parent the page does not name, several pools and an unknown
root) is left out: the sidecar then refuses it unless its config names it.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelCard:
    """The fields of one model-list entry the mapping uses."""

    id: str
    root: str | None = None
    parent: str | None = None


def parse_model_list(body: bytes) -> list[ModelCard] | None:
    """The cards of an OpenAI model list (`{"object": "list", "data": [...]}`); None when it is not one.

    Entries that are not objects with a string `id` are skipped; `root` and `parent` that are not strings
    read as absent.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    cards = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        root, parent = entry.get("root"), entry.get("parent")
        cards.append(
            ModelCard(
                entry["id"],
                root if isinstance(root, str) else None,
                parent if isinstance(parent, str) and parent else None,
            )
        )
    return cards


def names_by_pool(cards: Iterable[ModelCard], pools: Collection[str]) -> dict[str, tuple[str, ...]]:
    """Every listed name per pool (the pool first): base names by identity or shared `root` (the only pool
    when the page names one), adapters by their `parent`'s pool."""
    cards = list(cards)
    only = next(iter(pools)) if len(pools) == 1 else None
    roots = {c.root: c.id for c in cards if c.parent is None and c.id in pools and c.root}
    base: dict[str, str] = {}
    for card in cards:
        if card.parent is None:
            pool = card.id if card.id in pools else roots.get(card.root or "", only)
            if pool is not None:
                base[card.id] = pool
    out: dict[str, dict[str, None]] = {pool: {pool: None} for pool in pools}
    for card in cards:
        pool = base.get(card.id) if card.parent is None else base.get(card.parent)
        if pool is not None:
            out[pool][card.id] = None
    return {pool: tuple(names) for pool, names in out.items()}
