"""LangChain's own standard suites (langchain-tests) against a real sidecar.

``VectorStoreIntegrationTests`` (sync and async) runs against :class:`KalosVectorStore`, and
``RetrieversIntegrationTests`` against :class:`KalosRetriever`, unchanged (none is overridden or
skipped: the suite's own ``test_no_overrides_DO_NOT_OVERRIDE`` checks it), with the suite's
6-dimensional ``DeterministicFakeEmbedding``. Each test gets a fresh namespace of one
module-wide dimension-6 sidecar, so every store starts empty. The suites' async tests are plain
``async def`` methods: pytest-asyncio runs them (``asyncio_mode = "auto"`` in pyproject.toml).
"""
from __future__ import annotations

import uuid
from typing import Any, Iterator

import pytest

pytest.importorskip("langchain_tests")
pytest.importorskip("pytest_asyncio")

from conftest import DEADLINE_S  # noqa: E402
from langchain_core.embeddings import DeterministicFakeEmbedding  # noqa: E402
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_core.vectorstores import VectorStore  # noqa: E402
from langchain_tests.integration_tests import RetrieversIntegrationTests, VectorStoreIntegrationTests  # noqa: E402
from test_text import TextSidecar  # noqa: E402

from kalos import Client  # noqa: E402
from kalos.integrations.langchain import KalosRetriever, KalosVectorStore  # noqa: E402

EMBEDDING_SIZE = 6  # langchain_tests.integration_tests.vectorstores.EMBEDDING_SIZE


@pytest.fixture(scope="module")
def sidecar6() -> Iterator[TextSidecar]:
    sc = TextSidecar(EMBEDDING_SIZE)
    try:
        yield sc
    finally:
        sc.close()


@pytest.fixture(scope="module")
def client6(sidecar6: TextSidecar) -> Iterator[Client]:
    with Client(sidecar6.name, timeout=DEADLINE_S, embedder=DeterministicFakeEmbedding(size=EMBEDDING_SIZE)) as c:
        yield c


class TestKalosVectorStoreStandard(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, client6: Client) -> Iterator[VectorStore]:  # type: ignore[override]
        yield KalosVectorStore(client6, embedding=self.get_embeddings(), namespace=f"lcs-{uuid.uuid4().hex}")


QUERY = "what did the fox do?"
TEXTS = ["the quick brown fox jumps", "a lazy dog sleeps", "the fox ran into the woods", "rain in spring",
         "notes about foxes", "a red fox at dawn"]


class TestKalosRetrieverStandard(RetrieversIntegrationTests):
    @pytest.fixture(autouse=True)
    def _memories(self, client6: Client) -> None:
        # The suite builds retrievers from ``retriever_constructor_params`` alone (no fixture
        # argument), so the client and a namespace holding six memories are kept here.
        namespace = f"lcr-{uuid.uuid4().hex}"
        client6.remember(TEXTS, namespace=namespace)
        self._params = {"client": client6, "namespace": namespace}

    @property
    def retriever_constructor(self) -> type[BaseRetriever]:
        return KalosRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return self._params

    @property
    def retriever_query_example(self) -> str:
        return QUERY
