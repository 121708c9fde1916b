"""What a run carries and resumes from: the train state (float32 masters + optimizer state), the params of the lowest
held-out loss, and the resumable train state on disk (orbax).
"""
from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from kdtree_jax import checkpoint


class TrainState(NamedTuple):
    """What a train step updates (and donates): the float32 master params and the optimizer's state."""

    params: dict  # float32 masters
    opt_state: Any


class BestParams:
    """The lowest held-out loss seen so far: its step and metrics and, with `keep`, a device copy of its params (a copy,
    since the train step donates its state: a reference would not survive the next step)."""

    def __init__(self, keep: bool, step: int | None = None, held_out: dict | None = None, params=None):
        self.keep, self.step, self.held_out, self.params = keep, step, held_out, params

    def offer(self, step: int, held_out: dict, params) -> bool:
        """Record the evaluation `held_out` (with "loss") of `params` at `step`; True when it is the new best (the
        first one, or a strictly lower loss; a NaN loss never is)."""
        if self.step is not None and not held_out["loss"] < self.held_out["loss"]:
            return False
        self.step, self.held_out = step, held_out
        if self.keep:
            self.params = jax.tree.map(jnp.copy, params)
        return True

    def summary(self) -> dict:
        return {"step": self.step, "held_out": self.held_out}

    def to_save(self, step: int, params) -> tuple[int, Any]:
        """(step, params) of the checkpoint to ship: the best ones when kept, else the given last ones."""
        if not self.keep:
            return step, params
        if self.params is None:
            raise ValueError("no held-out evaluation was offered, so there are no best params to save; call "
                             "evaluate_final before saving")
        return self.step, self.params


class StateCheckpointer:
    """Resumable train state under `directory` (orbax, latest step only): TrainState, the kept best params + JSON meta.

    `identity` (JSON-able: the config, the target...) is stored with every save; restoring a state saved under another
    identity raises ValueError.
    """

    def __init__(self, directory: str, identity: dict):
        self.directory = os.path.abspath(directory)
        self.identity = json.loads(json.dumps(identity))

    def _manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(max_to_keep=1, create=True, enable_async_checkpointing=False)
        return ocp.CheckpointManager(self.directory, options=options,
                                     item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                    "meta": ocp.JsonCheckpointHandler()})

    def save(self, step: int, state: TrainState, meta: dict, best: BestParams) -> None:
        tree = state._asdict()
        if best.params is not None:
            tree["best_params"] = best.params
        meta = {**meta, "identity": self.identity, "best": best.summary(), "best_params": best.params is not None,
                "dense_layout": checkpoint.DENSE_LAYOUT}
        with self._manager() as mngr:
            mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)),
                      force=True)
            mngr.wait_until_finished()

    def restore(self, like: TrainState, keep_best: bool) -> tuple[TrainState, dict, BestParams] | None:
        """The latest saved (state, meta, best) in the layout of `like`, or None when nothing is saved. With
        `keep_best`, a state saved without best params starts a fresh BestParams (its best so far is lost)."""
        if not os.path.isdir(self.directory):
            return None
        with self._manager() as mngr:
            step = mngr.latest_step()
            if step is None:
                return None
            meta = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if meta.get("identity") != self.identity:
                raise ValueError(f"the train state in {self.directory} belongs to another run (config or target "
                                 f"differ); drop --resume or use another --state_dir")
            if meta.get("dense_layout") != checkpoint.DENSE_LAYOUT:
                raise ValueError(f"the train state in {self.directory} holds its dense weights and their optimizer "
                                 f"moments [in, out...] (saved before the model stored them [out..., in]); it cannot "
                                 f"be resumed: drop --resume or use another --state_dir")
            tree = like._asdict()
            if meta["best_params"]:
                tree["best_params"] = like.params
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
            tree = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        best_params = tree.pop("best_params", None)
        if keep_best and best_params is None:
            best = BestParams(keep=True)
        else:
            best = BestParams(keep_best, **meta["best"], params=best_params if keep_best else None)
        return TrainState(**tree), meta, best
