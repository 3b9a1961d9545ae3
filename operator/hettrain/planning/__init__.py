"""The pure planning core: device catalog, inventory, cost model, planner, plan schema."""
