"""The drafts shipped for the default target, as package data: one folder each, holding
``draft.safetensors`` and ``draft_card.json`` (see ``draft_service.token_draft``).

Find one with ``specdec.config.shipped_draft(name)`` (``importlib.resources.files("drafts")``), never
by a path relative to the source tree: installed, this folder sits in site-packages.
"""
