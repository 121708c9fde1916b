# Both targets bootstrap .venv with python3.12 (pyenv reads .python-version) when it is missing.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3.12 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) experiments/generate.py --config=tiny --init=random --policy=ar --prompt=1,2,3,4,5 --max_new_tokens=16 --json

test: $(STAMP)
	$(PY) -m pytest tests -m "not slow"

clean:
	rm -rf .venv
