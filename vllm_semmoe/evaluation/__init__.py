"""What a placement and its scheduling would give, computed offline: the evaluator
(:mod:`.evaluate`), the cost model (:mod:`.cost_model`), modelled step times
(:mod:`.step_time`), the time objective (:mod:`.time_objective`), the cost grid
(:mod:`.cost_grid`) and the report (:mod:`.report`)."""
