"""The merger as one streaming query for every entity (``merger.one_query``).

One query over every entity's bronze table (:mod:`cdc_shared.streaming.delta_union`),
each entity's rows of a micro-batch applied exactly as its own stream would apply them
(:class:`cdc_merger.merging.EntityMerge`: tombstones, truncates, history, quarantine).
Replaying bronze is harmless to the merger (every step compares sequences), so each
table starts at the bronze version its previous stream had reached.
"""

from __future__ import annotations

from cdc_shared.layout import MERGER, StorageLayout
from cdc_shared.streaming.delta_union import delta_tables_group

from cdc_merger.merging import EntityMerge

#: The merger's one stream over every entity's bronze (an ``OpenGroup``).
open_all_tables = delta_tables_group(MERGER, EntityMerge, StorageLayout.bronze)
