"""specdec's benchmarks, all in one place. Each writes a JSON report under reports/:

- ``bench.single``: one stream, specdec against transformers ``generate`` (``specdec bench``,
  ``make bench``);
- ``bench.load``: concurrent sessions in a closed loop (``specdec bench --concurrency``,
  ``make bench-load``);
- ``bench.pass_grid``: the target's pass cost by sessions and draft length, timed in process
  (``specdec pass-grid``, ``make pass-grid``);
- ``bench.long_prompt``: what a long prompt's prefill costs the sessions already streaming
  (``python -m bench.long_prompt``, ``make bench-long-prompt``).

``bench.cli`` adds the ``specdec`` subcommands; ``prompts.jsonl``, the prompt set they share, ships
as package data (``bench.single.PROMPTS``).
"""
