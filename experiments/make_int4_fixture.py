"""Write tests/fixtures/int4_pack_quantized.safetensors: INT4 expert weights packed by the compressed-tensors library's
own packer (`PackedQuantizationCompressor.compress`, the code that writes Kimi K2.x checkpoints), so that the INT4
layout of pallas_kernels/int4_layout.py is pinned by an outside implementation (tests/test_int4_layout.py).

Run once, where torch and compressed-tensors are installed (the project needs neither; transformers is not needed):
  python3 -m venv /tmp/ct && /tmp/ct/bin/pip install torch compressed-tensors safetensors numpy absl-py
  PYTHONPATH=. /tmp/ct/bin/python experiments/make_int4_fixture.py --out=tests/fixtures/int4_pack_quantized.safetensors
(made with torch 2.14.1 and compressed-tensors 0.20.1; `pip install --no-deps compressed-tensors` then pydantic,
loguru and psutil avoids its transformers pin).

The file holds, for E experts of [OUT, IN] (one expert = one Linear, compressed one at a time as the library does):
  q               int8  [E, OUT, IN]     the integer weights, random in [-8, 7]; every nibble value at every one of the
                                         8 positions in a word
  weight_scale    bf16  [E, OUT, IN/32]  random group scales, symmetric group-32 quantization
  weight          f32   [E, OUT, IN]     q * scale (exact in float32), the library's input
  weight_packed   int32 [E, OUT, IN/8]   the library's output
  weight_shape    int64 [E, 2]           the library's output
  decompressed    bf16  [E, OUT, IN]     the library's `decompress` of its own output (in the scale's dtype: `weight`
                                         rounded to bf16)
Metadata: the torch and compressed-tensors versions.
"""
from __future__ import annotations

import importlib.metadata

import numpy as np
from absl import flags

from kdtree_jax import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "tests/fixtures/int4_pack_quantized.safetensors", "file to write")
flags.DEFINE_integer("seed", 0, "seed of q and the scales")

EXPERTS, OUT, IN, GROUP = 2, 8, 64, 32


def main(argv):
    del argv
    import torch
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import save_file

    rng = np.random.default_rng(FLAGS.seed)
    q = rng.integers(-8, 8, size=(EXPERTS, OUT, IN)).astype(np.int8)
    pairs = {(k % 8, v) for row in q.reshape(-1, IN).tolist() for k, v in enumerate(row)}  # (position, value)
    if len(pairs) != 8 * 16:
        raise ValueError(f"seed {FLAGS.seed} leaves some (position, nibble) pair out; pick another seed")
    scale = torch.tensor(rng.uniform(0.01, 0.1, size=(EXPERTS, OUT, IN // GROUP)), dtype=torch.bfloat16)
    weight = torch.tensor(q, dtype=torch.float32) * scale.float().repeat_interleave(GROUP, dim=-1)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))
    packed, shapes, decompressed = [], [], []
    for e in range(EXPERTS):
        out = PackedQuantizationCompressor.compress({"weight": weight[e], "weight_scale": scale[e]}, scheme)
        packed.append(out["weight_packed"])
        shapes.append(out["weight_shape"])
        back = PackedQuantizationCompressor.decompress(dict(out), scheme)
        decompressed.append(back["weight"])
    tensors = {"q": torch.tensor(q), "weight_scale": scale, "weight": weight, "weight_packed": torch.stack(packed),
               "weight_shape": torch.stack(shapes).to(torch.int64), "decompressed": torch.stack(decompressed)}
    if not torch.equal(tensors["decompressed"], weight.to(scale.dtype)):
        raise ValueError("compressed-tensors' decompress does not return its input; the fixture would be wrong")
    save_file(tensors, FLAGS.out, metadata={
        "torch": importlib.metadata.version("torch"),
        "compressed-tensors": importlib.metadata.version("compressed-tensors"),
        "made_by": "experiments/make_int4_fixture.py"})
    print(f"wrote {FLAGS.out}: " + ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in tensors.items()))


if __name__ == "__main__":
    cli.run(main)
