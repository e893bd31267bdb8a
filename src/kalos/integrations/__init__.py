"""Adapters to agent frameworks, each an optional extra: ``kalos.integrations.langchain``
(``pip install 'kalos-recall[langchain]'``: langchain-core only)."""
