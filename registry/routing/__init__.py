"""The route table: which chain serves each route (``routes``), canary splits
(``variants``), and what it is built from, each version's record (``records``)."""
