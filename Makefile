# Both targets bootstrap .venv with python3.12 (pyenv reads .python-version) when it is missing.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3.12 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# AR and DDTree side by side on a held-out stdlib prompt, with the shipped target, drafter and tokenizer.
demo: $(STAMP)
	PYTHONPATH=. $(PY) experiments/generate.py --init=checkpoints/target --drafter=checkpoints/drafter \
	    --tokenizer=checkpoints/tokenizer.json --held_out_prompts=1 --policy=ddtree --budget=auto \
	    --max_new_tokens=64 --compare --json

# Two workers (pytest-xdist; CI has 2 cores), each test file whole on one worker so module fixtures are built once.
test: $(STAMP)
	PYTHONPATH=. $(PY) -m pytest tests -m "not slow" -n 2 --dist loadfile

clean:
	rm -rf .venv
