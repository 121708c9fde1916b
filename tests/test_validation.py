"""Every input checked before the expensive work, by class (kdtree_jax/cli.py, each script's `check`).

In this process, through `cli.refusal` (the scripts' own flag definitions and checks, the message `error:` would
print): every flag of every script gets values of the wrong type, negative, zero, huge, non-finite and empty, and
every file a model directory may hold gets missing, empty, invalid JSON, JSON of the wrong type and wrong values. Each
input is refused with one line naming the flag (or accepted); no other exception (a traceback) may escape. Classes of
values that can never be right (negative sizes, NaN, a list with no entry, text where a number goes) must be refused.
Then the order: a drafter that does not fit a target the size of Kimi K2.6 is refused by each script before any
tensor or safetensors header is read. The end-to-end reporting (exit 2, one line, no traceback) is checked by a few
child processes here and in test_cli.py.
"""
import dataclasses
import importlib
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from flax import nnx

from kdtree_jax import checkpoint, cli, config, hf_import, model_dir
from kdtree_jax.decode import DecodeSpec, Decoder, NonFiniteLogits
from kdtree_jax.drafter import Drafter
from kdtree_jax.model.transformer import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
KIMI = os.path.join(FIXTURES, "kimi_k26_tiny")
DFLASH = os.path.join(FIXTURES, "dflash_tiny")
HF_BF16 = os.path.join(FIXTURES, "hf_deepseek_v3_bf16")
SCRIPTS = ("generate", "bench_decode", "bench_round", "export_dflash", "memory_plan", "compare_meshes", "bench_k26",
           "budget_ceiling")
HUGE = "9" * 20

# Values per absl flag type; NEVER_RIGHT: values a flag of that type must refuse whatever it means.
BAD_VALUES = {
    "int": ["abc", "1.5", "", "-1", "0", HUGE, "nan"],
    "float": ["abc", "", "-1", "0", "1e400", "nan", "inf", "-inf", HUGE],
    "list": ["", ",", "a,b", "-1", "0", "1.5", "nan", HUGE, "1,,2"],
    "string": ["", "/nonexistent/path", "{dir}", "{file}", "-1", "nan"],
    "multi_string": ["", "/nonexistent/path", "-1", "nan"],
    "bool": ["maybe", "2"],
    "enum": ["bogus", ""],
}
NEVER_RIGHT = {"int": {"abc", "1.5", "", "-1", HUGE, "nan"},
               "float": {"abc", "", "-1", "1e400", "nan", "inf", "-inf"},
               "list": {"", ",", "a,b", "-1", "nan", "1,,2"},
               "bool": {"maybe", "2"}, "enum": {"bogus", ""}}
# Flags with nothing to check: their values are free text or only change what is printed.
FREE = {"debug", "json", "markdown", "compare", "chat", "overwrite", "append", "plot", "fast_compile", "compile_only",
        "check_finite"}


def script(name: str):
    return importlib.import_module(f"experiments.{name}")


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory):
    """A tiny target checkpoint of ours and two drafters: one for it (not reading its last layer, so exportable),
    and one for another target (hidden size 32: it fits no target here)."""
    root = tmp_path_factory.mktemp("ckpt")
    target = Transformer(config.tiny(), nnx.Rngs(0))
    drafter_cfg = config.tiny_drafter(target.cfg, 4).replace(target_layer_ids=(0, 1))
    checkpoint.save(root / "target", target)
    checkpoint.save(root / "drafter", Drafter(drafter_cfg, target.cfg, nnx.Rngs(1)))
    other = config.tiny().replace(hidden_size=32)
    checkpoint.save(root / "misfit", Drafter(config.tiny_drafter(other, 4), other, nnx.Rngs(2)))
    return {k: str(root / k) for k in ("target", "drafter", "misfit")}


def base_argv(name: str, out: str, ckpt: dict) -> list[str]:
    """A valid, cheap command line of each script (its outputs under `out`)."""
    return {
        "generate": ["--prompt=1,2,3", "--max_new_tokens=4", f"--out={out}/g.json"],
        "bench_decode": [f"--out={out}/d.json", f"--plot={out}/d.png", "--num_prompts=2"],
        "bench_round": ["--init=random", "--drafter=random", "--config=tiny", f"--out={out}/r.json"],
        "export_dflash": [f"--drafter={ckpt['drafter']}", f"--target={ckpt['target']}", f"--out={out}/x"],
        "memory_plan": ["--config=tiny", "--tp=2"],
        "compare_meshes": ["--mesh=tp=1", f"--out={out}/c.json"],
        "budget_ceiling": [f"--out={out}/b.json", f"--plot={out}/b.png", "--num_prompts=2"],
        "bench_k26": ["--scale=tiny", "--layers=2", "--prefix=64", "--budgets=4", "--mesh=tp=1", f"--out={out}/k.json"],
    }[name]


def refusal(name: str, argv: list[str]) -> str | None:
    module = script(name)
    return cli.refusal(module.define_flags, module.check, argv)


def assert_one_line(message: str) -> None:
    assert message and "\n" not in message and "Traceback" not in message, message


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_refuses_what_can_never_be_right(name, tmp_path, tiny_checkpoints):
    base = base_argv(name, str(tmp_path), tiny_checkpoints)
    assert refusal(name, base) is None, refusal(name, base)
    fv = flags.FlagValues()
    script(name).define_flags(fv)
    (tmp_path / "a_file").write_text("x")
    tried = 0
    for flag_name in fv:
        kind = fv[flag_name].flag_type()
        kind = "enum" if kind.startswith("enum") else "list" if "list" in kind else kind
        for value in BAD_VALUES.get(kind, []):
            value = value.format(dir=tmp_path, file=tmp_path / "a_file")
            argv = [a for a in base if not a.startswith(f"--{flag_name}=")] + [f"--{flag_name}={value}"]
            message = refusal(name, argv)
            tried += 1
            if message is None:
                assert flag_name in FREE or value not in NEVER_RIGHT.get(kind, ()), (flag_name, value)
                continue
            assert_one_line(message)
            named = f"--{flag_name}" in message or (flag_name == "config" and "--config" in message)
            assert named or flag_name in ("drafter", "target", "init", "out") and "--" in message, (flag_name, value,
                                                                                                   message)
    assert tried > 10


# ----------------------------------------------------------------------------------------------- model files

def linked_copy(src: str, dst) -> str:
    """dst holding links to every file of src (a file to be changed is unlinked and rewritten)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
    return str(dst)


def replace(directory: str, name: str, text: str | None) -> None:
    path = os.path.join(directory, name)
    if os.path.lexists(path):
        os.unlink(path)
    if text is not None:
        with open(path, "w") as f:
            f.write(text)


JSON_VARIANTS = [None, "", "{", "[]", "5", '"text"', "null"]  # missing, empty, invalid, of the wrong type
FIELD_VALUES = ["abc", -1, 0, [], {}, None, 1e308, True]  # wrong values of any field


def json_field_variants(text: str) -> list[str]:
    """The JSON object `text` with each top-level field (and each of a nested text_config / dflash_config) set to
    each wrong value."""
    obj = json.loads(text)
    out = []
    for nest in ([], ["text_config"], ["dflash_config"]):
        inner = obj
        for key in nest:
            inner = inner.get(key) if isinstance(inner, dict) else None
        if not isinstance(inner, dict):
            continue
        for field in inner:
            for value in FIELD_VALUES:
                changed = json.loads(text)
                target = changed
                for key in nest:
                    target = target[key]
                target[field] = value
                out.append(json.dumps(changed))
    return out


def each_outcome(name: str, argv: list[str], directory: str, file: str, variants) -> int:
    original = os.readlink(os.path.join(directory, file)) if os.path.islink(os.path.join(directory, file)) else None
    for text in variants:
        replace(directory, file, text)
        message = refusal(name, argv)
        if message is not None:
            assert_one_line(message)
    replace(directory, file, None)
    if original:
        os.symlink(original, os.path.join(directory, file))
    return len(variants)


def test_malformed_files_of_an_hf_target_and_its_tokenizer(tmp_path):
    """Every file of a K2.6-layout directory with its tokenizer, broken each way: one line, or accepted."""
    target = linked_copy(KIMI, tmp_path / "kimi")
    argv = [f"--init={target}", f"--drafter={DFLASH}", "--policy=ddtree", "--chat", "--prompt=hi",
            "--max_new_tokens=4", "--budget=4"]
    assert refusal("generate", argv) is None
    tried = 0
    for file in ("config.json", "tokenizer_config.json", "model.safetensors.index.json"):
        with open(os.path.join(KIMI, file)) as f:
            text = f.read()
        tried += each_outcome("generate", argv, target, file, JSON_VARIANTS + json_field_variants(text))
    tried += each_outcome("generate", argv, target, "generation_config.json", JSON_VARIANTS + [
        json.dumps({"eos_token_id": v}) for v in ("213", 5000, [], [1, "x"], None, {}, True, -1, [511, 512])])
    tried += each_outcome("generate", argv, target, "tiktoken.model", [None, "", "garbage\n", "QQ== x\n"])
    tried += each_outcome("generate", argv, target, "chat_template.jinja", [
        "", "{% if %}", "{{ raise_exception('no system turn') }}", "{{ messages[5]['content'] }}",
        "{{ messages[0].content | tojson }}"])
    tried += each_outcome("generate", argv, target, "model-00002-of-00005.safetensors", [None, "", "x" * 100])
    assert tried > 300


def test_malformed_files_of_a_dflash_drafter(tmp_path):
    drafter = linked_copy(DFLASH, tmp_path / "dflash")
    argv = [f"--init={KIMI}", f"--drafter={drafter}", "--policy=ddtree", "--prompt=1,2", "--tokenizer=none",
            "--max_new_tokens=4", "--budget=4"]
    assert refusal("generate", argv) is None
    with open(os.path.join(DFLASH, "config.json")) as f:
        text = f.read()
    each_outcome("generate", argv, drafter, "config.json", JSON_VARIANTS + json_field_variants(text))
    each_outcome("generate", argv, drafter, "model.safetensors", [None, "", "x" * 100])


def test_malformed_files_of_our_checkpoints(tmp_path, tiny_checkpoints):
    """The meta item, the file sizes and orbax's own metadata of a drafter checkpoint of ours, broken each way."""
    drafter = str(tmp_path / "drafter")
    shutil.copytree(tiny_checkpoints["drafter"], drafter)
    argv = [f"--init={tiny_checkpoints['target']}", f"--drafter={drafter}", "--policy=ddtree", "--prompt=1,2",
            "--max_new_tokens=4", "--budget=4"]
    assert refusal("generate", argv) is None
    step = os.path.join(drafter, "0")
    with open(os.path.join(step, "meta", "metadata")) as f:
        meta = f.read()
    for file, variants in (("meta/metadata", JSON_VARIANTS + json_field_variants(meta)
                            + [json.dumps({**json.loads(meta), "config": {**json.loads(meta)["config"], k: v}})
                               for k in json.loads(meta)["config"] for v in ("abc", -1, [], None)]),
                           (checkpoint.FILE_SIZES, JSON_VARIANTS + ['{"a": "b"}', '{"meta/metadata": 1}']),
                           ("_CHECKPOINT_METADATA", JSON_VARIANTS)):
        path = os.path.join(step, file)
        with open(path) as f:
            original = f.read()
        for text in variants:
            if text is None:
                os.unlink(path)
            else:
                with open(path, "w") as f:
                    f.write(text)
            message = refusal("generate", argv)
            if message is not None:
                assert_one_line(message)
        with open(path, "w") as f:
            f.write(original)


# ----------------------------------------------------------------------------------------------- wrong as right

def test_inputs_that_used_to_run_wrong_are_refused(tmp_path):
    """A tokenizer of another model (vocabulary, EOS), an EOS the model has no token for, a silently replaced
    block size, processes that would run alone: refused, naming the flag."""
    assert "another model's tokenizer" in refusal("generate", [f"--init={HF_BF16}", f"--tokenizer={KIMI}",
                                                               "--prompt=hi"])
    assert "another model's tokenizer" in refusal("bench_decode", [f"--tokenizer={KIMI}", f"--out={tmp_path}/d.json",
                                                                   "--plot="])
    target = linked_copy(HF_BF16, tmp_path / "hf")
    for eos in ('"213"', "5000", "[]"):
        replace(target, model_dir.GENERATION_CONFIG, f'{{"eos_token_id": {eos}}}')
        assert "eos_token_id" in refusal("generate", [f"--init={target}", "--prompt=1,2"])
    assert refusal("generate", ["--prompt=1", "--block_size=0", "--policy=ddtree"]).startswith("--block_size=0")
    for argv in (["--num_processes=2", "--process_id=1"], ["--process_id=1"]):
        assert "needs --coordinator" in refusal("generate", ["--prompt=1", *argv])
    assert "tiktoken.model" in refusal("generate", [f"--init={HF_BF16}", "--prompt=hello"])  # says what it lacks
    assert "--tokenizer=none: turns the tokenizer off" in refusal("generate", ["--prompt=hi", "--chat", "--tokenizer=none"])
    (tmp_path / "exists.json").write_text("{}")
    assert "pass --overwrite" in refusal("generate", ["--prompt=1", f"--out={tmp_path}/exists.json"])
    assert refusal("generate", ["--prompt=1", f"--out={tmp_path}/exists.json", "--overwrite"]) is None
    assert "is a file" in refusal("generate", ["--prompt=1", f"--out={tmp_path}/exists.json/x"])


def test_non_finite_weights_are_refused_at_import_naming_the_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file
    target = linked_copy(HF_BF16, tmp_path / "hf")
    tensors = load_file(os.path.join(HF_BF16, "model.safetensors"))
    name = "model.layers.1.self_attn.q_a_proj.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][3, 5] = np.nan
    os.unlink(os.path.join(target, "model.safetensors"))
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"tensor '{name}' .* holds 1 non-finite value\(s\) \(nan at \[3, 5\]\)"):
        hf_import.load_hf_checkpoint(target, progress=False)

    model = Transformer(config.tiny(), nnx.Rngs(0))
    model.lm_head[...] = model.lm_head[...].at[0, 0].set(np.inf)
    checkpoint.save(tmp_path / "ours", model)
    with pytest.raises(ValueError, match="non-finite values .* in lm_head"):
        checkpoint.restore_target(tmp_path / "ours")


def test_a_round_with_non_finite_logits_stops_the_run_naming_stream_and_position():
    """A NaN embedding row of the token stream 0 generates at index k: the ar round that feeds it (k + 1 tokens out)
    has NaN logits and stops the run naming stream 0 at k + 1; ddtree stops there or earlier (a drafted node may
    carry that token first). A NaN in a prompt token of stream 1 is caught at prefill (position 0). With check_finite
    off the same run ends without a word (the old behaviour)."""
    target = Transformer(config.tiny(), nnx.Rngs(0))
    drafter = Drafter(config.tiny_drafter(target.cfg, 4), target.cfg, nnx.Rngs(1))
    prompts = [[5, 9, 14, 3], [11, 2, 7, 8]]
    decoder = Decoder(target, drafter)
    ar = DecodeSpec(policy="ar", max_new_tokens=6, block_size=4)
    clean = decoder.generate(prompts, ar).tokens
    k = next(i for i in range(1, len(clean[0])) if clean[0][i] not in clean[0][:i] + clean[1] + sum(prompts, []))
    embed = decoder.target_params["embed_tokens"]
    embed.set_value(embed.get_value().at[clean[0][k]].set(np.nan))  # the compiled loops take params as arguments
    with pytest.raises(NonFiniteLogits, match=rf"for stream 0 at generated token {k + 1} \(position {4 + k + 1}\)"):
        decoder.generate(prompts, ar)
    with pytest.raises(NonFiniteLogits, match=r"for stream 0 at generated token (\d+)") as caught:
        decoder.generate(prompts, DecodeSpec(policy="ddtree", budget=4, max_new_tokens=6, block_size=4))
    assert 1 <= int(re.search(r"generated token (\d+)", str(caught.value)).group(1)) <= k + 1
    decoder.generate(prompts, dataclasses.replace(ar, check_finite=False))
    with pytest.raises(NonFiniteLogits, match=r"for stream 1 at generated token 0 \(position 4\)"):
        decoder.generate([prompts[0], [11, clean[0][k], 7, 8]], ar)


# ----------------------------------------------------------------------------------------------- order

@pytest.fixture(scope="module")
def k26_target(tmp_path_factory):
    """A Kimi K2.6 config.json beside a small safetensors file that holds none of its tensors: reading a header or
    a tensor of it would fail with another error than the drafter's misfit."""
    directory = tmp_path_factory.mktemp("k26")
    with open(directory / "config.json", "w") as f:
        json.dump(hf_import.hf_config_dict(config.kimi_k2_6(), nested=True), f)
    from safetensors.numpy import save_file
    save_file({"unrelated": np.zeros(4, np.float32)}, str(directory / "model.safetensors"))
    return str(directory)


@pytest.fixture
def no_tensor_read(monkeypatch):
    """Reading any safetensors header or tensor, or restoring any array of a checkpoint of ours, fails the test."""
    def refused(*args, **kwargs):
        raise AssertionError("a tensor file was read before every input was checked")
    monkeypatch.setattr(hf_import._TensorFiles, "__init__", refused)
    monkeypatch.setattr(checkpoint, "_restore_params", refused)


@pytest.mark.parametrize("name", ["generate", "bench_decode", "bench_round", "export_dflash", "compare_meshes"])
def test_a_drafter_that_does_not_fit_a_large_target_is_refused_before_any_tensor_is_read(
        name, k26_target, tiny_checkpoints, no_tensor_read, tmp_path):
    argv = {"generate": [f"--init={k26_target}", f"--drafter={DFLASH}", "--policy=ddtree", "--prompt=1,2"],
            "bench_decode": [f"--target={k26_target}", f"--drafter={DFLASH}", f"--out={tmp_path}/d.json", "--plot="],
            "bench_round": [f"--init={k26_target}", f"--drafter={DFLASH}", f"--out={tmp_path}/r.json"],
            "export_dflash": [f"--target={k26_target}", f"--drafter={tiny_checkpoints['drafter']}",
                              f"--out={tmp_path}/x"],
            "compare_meshes": [f"--drafter={tiny_checkpoints['misfit']}", "--mesh=tp=1",
                               f"--out={tmp_path}/c.json"]}[name]
    module = script(name)
    message = cli.refusal(module.define_flags, module.run, argv)  # the script's whole run, not only its check
    assert message is not None and message.startswith("--drafter="), message
    assert any(why in message for why in ("hidden_size", "num_target_layers", "vocab_size")), message


@pytest.mark.parametrize("name, argv, spied", [
    ("memory_plan", ["--context=-100"], "memory_plan"),
    ("bench_k26", ["--scale=tiny", "--budgets=-1"], "make_params"),
])
def test_sizes_are_refused_before_a_model_is_built(name, argv, spied, monkeypatch):
    module = script(name)
    monkeypatch.setattr(module, spied, lambda *a, **k: pytest.fail(f"{spied} ran before the flags were checked"))
    assert cli.refusal(module.define_flags, module.run, argv).startswith(argv[-1])


# ----------------------------------------------------------------------------------------------- outputs

def test_export_refuses_an_existing_directory_and_writes_the_usual_permissions(tmp_path, tiny_checkpoints):
    module = script("export_dflash")
    out = tmp_path / "exported"
    argv = [f"--drafter={tiny_checkpoints['drafter']}", f"--target={tiny_checkpoints['target']}", f"--out={out}"]
    umask = os.umask(0o022)
    try:
        assert cli.refusal(module.define_flags, module.run, argv) is None
    finally:
        os.umask(umask)
    for name in ("config.json", "model.safetensors"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644, name
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755
    assert "exists; pass --overwrite" in cli.refusal(module.define_flags, module.run, argv)
    assert cli.refusal(module.define_flags, module.run, argv + ["--overwrite"]) is None


# ----------------------------------------------------------------------------------------------- processes

def test_a_join_no_one_answers_gives_up_after_the_timeout_with_one_error_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "generate.py"), "--prompt=1,2",
                           f"--coordinator=127.0.0.1:{port}", "--num_processes=2", "--process_id=1",
                           "--join_timeout_s=2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == f"process 1 of 2: joining at 127.0.0.1:{port}, waiting up to 2 s for process 0 at " \
                       f"127.0.0.1:{port}"
    assert lines[-1].startswith(f"error: --coordinator=127.0.0.1:{port}: process 1 of 2 gave up after 2 s")
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_memory_plan_refuses_a_negative_size_in_one_line():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "memory_plan.py"), "--context=-100"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: --context=-100: must be an integer >= 1\n"
