"""BuddyMoE's buddy profiles as the runtime reads them: a profile (made by zipmoe-buddies, zipmoe_py/buddies.py)
checked against the model it is to serve, and handed to the expert cache. docs/PLAN_FORMAT.md, BUDDY PROFILE."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from . import _lib
from .errors import ZipMoEError

FORMAT = "zipmoe-buddy-profile"
VERSION = 1


def fingerprint(model: Path) -> dict:
    """What a profile records of its model: file name, MoE layers with their expert counts, and a
    hash of every expert's SM-chunk checksum (the same for any codec of the same weights)."""
    from . import format as zformat

    digest = hashlib.sha256()
    layers = {}
    with zformat.ZipMoEFile(model) as zf:
        for layer, tensors in zf.moe_layers().items():
            n_expert = zf.shape(zf.tensors[tensors[0]])[2]
            layers[str(layer)] = n_expert
            for t in tensors:
                for e in range(n_expert):
                    digest.update(zf.chunks(zf.tensors[t], e)[0].checksum.to_bytes(8, "little"))
    return {"file": Path(model).name, "layers": layers, "fingerprint": digest.hexdigest()}


def load_profile(path: Path, model: Path) -> dict:
    """A buddy profile, checked against the model it is to serve; ZipMoEError names what is wrong."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except OSError as e:
        raise ZipMoEError(f"cannot read buddy profile {path}: {e.strerror}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ZipMoEError(f"buddy profile {path} is not JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ZipMoEError(f"{path} is not a buddy profile (its format is not {FORMAT!r}; make one with zipmoe-buddies)")
    if doc.get("version") != VERSION:
        raise ZipMoEError(f"buddy profile {path} has version {doc.get('version')!r}; this ZipMoE reads version {VERSION}")
    made_for = doc.get("model") or {}
    this = fingerprint(model)
    if made_for.get("fingerprint") != this["fingerprint"] or made_for.get("layers") != this["layers"]:
        raise ZipMoEError(f"buddy profile {path} was made for model {made_for.get('file')!r} "
                          f"(fingerprint {str(made_for.get('fingerprint'))[:12]}), not {Path(model).name} "
                          f"(fingerprint {this['fingerprint'][:12]}): make one for this model with zipmoe-buddies")
    layers = doc.get("layers")
    if not isinstance(layers, dict) or set(layers) != set(this["layers"]):
        raise ZipMoEError(f"buddy profile {path}: its layers {sorted(layers or {})} are not the model's MoE layers")
    for layer, entry in layers.items():
        n = this["layers"][layer]
        buddies, qs, tau = entry.get("buddies"), entry.get("q"), entry.get("tau")
        ok = (isinstance(buddies, list) and isinstance(qs, list) and len(buddies) == n and len(qs) == n and
              isinstance(tau, (int, float)) and 0 <= tau <= 1)
        ok = ok and all(isinstance(b, list) and isinstance(q, list) and len(b) == len(q) and
                        all(isinstance(j, int) and 0 <= j < n and j != i for j in b) and
                        all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in q)
                        for i, (b, q) in enumerate(zip(buddies, qs)))
        if not ok:
            raise ZipMoEError(f"buddy profile {path}: layer {layer} is malformed (it needs {n} buddy lists of expert "
                              f"ids in [0, {n}) without the pivot, their q values in [0, 1], and tau in [0, 1])")
    return doc


def apply_profile(model, doc: dict) -> None:
    """Hands a loaded profile's lists to the cache of each layer of a llama_model (ggml_zipmoe_cache_set_buddies)."""
    from .slot_sets import cache_of_layer

    for layer, entry in doc["layers"].items():
        cache = cache_of_layer(model, int(layer))
        n = len(entry["buddies"])
        k_max = max(1, max((len(b) for b in entry["buddies"]), default=1))
        ids = np.full((n, k_max), -1, dtype=np.int32)
        q = np.zeros((n, k_max), dtype=np.float32)
        for i, (b, v) in enumerate(zip(entry["buddies"], entry["q"])):
            ids[i, :len(b)] = b
            q[i, :len(v)] = v
        status = _lib.lib().ggml_zipmoe_cache_set_buddies(cache, int(layer), ids.ctypes.data, q.ctypes.data, k_max,
                                                          float(entry["tau"]))
        if status != _lib.OK:
            raise ZipMoEError(f"layer {layer}: the buddy lists were refused ({_lib.status_string(status)})")
