"""Training of the project's target and DFlash drafter, shared by experiments/train_target.py and
experiments/train_drafter.py (DESIGN.md section 7). Nothing is re-exported: import from the module of the concern.

    precision.py          float32 master params and the cast to the model's own dtypes
    optim.py              AdamW with warmup + cosine, the frozen router bias, the update step
    target_objective.py   the target's next-token loss, expert loads and router-bias balancing, its jitted steps
    drafter_objective.py  anchors, draft blocks, the position-weighted drafter loss, its jitted steps
    corpus.py             the token streams (training split, held-out split) and the held-out windows
    train_state.py        TrainState, the best held-out params, the resumable train state on disk
    loop.py               the budget, the train loop with its held-out evaluations, the loss history
    run.py                the scripts' flags -> RunConfig, process setup, results JSON and plot, the saved model
"""
