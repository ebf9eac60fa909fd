"""The switchable registry proxy, now the dev kit's (``cdc_devkit.registry_proxy``):
``cdc chaos`` stages registry outages with it too. Re-exported for the tests."""

from __future__ import annotations

from cdc_devkit.registry_proxy import Mode, RegistryProxy, registry_proxy

__all__ = ["Mode", "RegistryProxy", "registry_proxy"]
