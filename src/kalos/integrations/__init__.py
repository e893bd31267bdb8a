"""Adapters to agent frameworks, each an optional extra: ``kalos.integrations.langchain``
(``pip install 'kalos-recall[langchain]'``: langchain-core only), ``kalos.integrations.langgraph``
(``[langgraph]``: a LangGraph ``BaseStore``) and ``kalos.integrations.mem0`` (``[mem0]``: a mem0
vector store provider)."""
