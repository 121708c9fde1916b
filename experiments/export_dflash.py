"""Export a drafter checkpoint of ours as a DFlash drafter directory in the published format (z-lab/dflash
`DFlashDraftModel`, what SGLang's `--speculative-algorithm DFLASH --speculative-draft-model-path DIR` loads).

  PYTHONPATH=. .venv/bin/python experiments/export_dflash.py --drafter=DRAFTER_CKPT --target=TARGET --out=DIR

--target is the target the drafter was trained on (a checkpoint of ours or an HF directory; only its config is read:
layer count, vocabulary, positions). Its weights go out with the target, e.g. with
kdtree_jax.hf_import.export_hf_checkpoint. A drafter that reads the target's last layer is refused (the published
format defines that layer's hidden state differently: kdtree_jax/dflash_format.py).
"""
from __future__ import annotations

from absl import flags, logging

from kdtree_jax import cli, dflash_format, model_dir
from kdtree_jax.checkpoint import restore_drafter

FLAGS = flags.FLAGS
flags.DEFINE_string("drafter", None, "drafter checkpoint directory of ours", required=True)
flags.DEFINE_string("target", None, "the target it drafts for: a checkpoint of ours or an HF directory", required=True)
flags.DEFINE_string("out", None, "directory to write (config.json + model.safetensors)", required=True)
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "dtype of the stored weights")


def main(argv):
    del argv
    logging.set_verbosity(logging.ERROR)  # keep checkpoint-library chatter out of the report
    target = model_dir.target_config(FLAGS.target)
    drafter = restore_drafter(FLAGS.drafter, target)
    out = dflash_format.export_dflash_drafter(drafter, target, FLAGS.out, dtype=FLAGS.dtype)
    print(f"wrote {out}: {drafter.cfg.num_layers} layers, block {drafter.cfg.block_size}, "
          f"target layers {list(drafter.cfg.target_layer_ids)}")


if __name__ == "__main__":
    cli.run(main)
