"""Export a drafter checkpoint of ours as a DFlash drafter directory in the published format (z-lab/dflash
`DFlashDraftModel`, what SGLang's `--speculative-algorithm DFLASH --speculative-draft-model-path DIR` loads).

  PYTHONPATH=. .venv/bin/python experiments/export_dflash.py --drafter=DRAFTER_CKPT --target=TARGET --out=DIR

--target is the target the drafter was trained on (a checkpoint of ours or an HF directory; only its config is read:
layer count, vocabulary, positions). Its weights go out with the target, e.g. with
kdtree_jax.hf_import.export_hf_checkpoint. A drafter that reads the target's last layer is refused (the published
format defines that layer's hidden state differently: kdtree_jax/dflash_format.py). Everything is checked before the
drafter's weights are read: the drafter's fit to the target from the two configs, and --out, which must not exist
unless --overwrite (then its config.json and model.safetensors are replaced). Files are written 0666 less the umask.
"""
from __future__ import annotations

from absl import flags, logging

from kdtree_jax import cli, dflash_format, model_dir
from kdtree_jax.checkpoint import restore_drafter

FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    flags.DEFINE_string("drafter", None, "drafter checkpoint directory of ours", required=True, flag_values=fv)
    flags.DEFINE_string("target", None, "the target it drafts for: a checkpoint of ours or an HF directory",
                        required=True, flag_values=fv)
    flags.DEFINE_string("out", None, "directory to write (config.json + model.safetensors)", required=True,
                        flag_values=fv)
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "dtype of the stored weights", flag_values=fv)
    cli.define_overwrite(fv)


def check(f):
    """(target config, drafter config), every input checked before a weight is read."""
    cli.output_path(f, "out", directory=True)
    with cli.about(f, "target"):
        if model_dir.checkpoint_kind(f.target) == model_dir.RANDOM:
            raise ValueError("a drafter is exported for the target it was trained on: name its checkpoint or HF "
                             "directory")
        target = model_dir.target_config(f.target)
    with cli.about(f, "drafter"):
        if model_dir.checkpoint_kind(f.drafter) != model_dir.ORBAX:
            raise ValueError("is not a drafter checkpoint of ours (numbered step directories); only those are "
                             "exported")
        drafter = model_dir.drafter_config(f.drafter, target)
        dflash_format.check_exportable(drafter, target)
    return target, drafter


def run(f) -> None:
    logging.set_verbosity(logging.ERROR)  # keep checkpoint-library chatter out of the report
    target, _ = check(f)
    drafter = restore_drafter(f.drafter, target)
    out = dflash_format.export_dflash_drafter(drafter, target, f.out, dtype=f.dtype)
    print(f"wrote {out}: {drafter.cfg.num_layers} layers, block {drafter.cfg.block_size}, "
          f"target layers {list(drafter.cfg.target_layer_ids)}")


if __name__ == "__main__":
    cli.script(define_flags, run)
