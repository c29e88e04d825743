"""The builder of longpatch's offline demo model; its command line is scripts/build_demo_model.py.

- data: the stdlib's files, the tokenizer, the token stream and the training mix (`Mixer`);
- recipe: the stages and phases (`STAGES`, `--phases`), the learning-rate schedule, the hyperparameters;
- model: the LlamaForCausalLM and the RoPE settings it ships with;
- train: a build's setup from its checkpoint, the training loop, the losses and retrieval probes;
- report: training.json, the held-out evaluation set, the model card and the needle report.
"""
