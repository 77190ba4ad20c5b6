"""The optimizer formulas the row-sparse tests run: every optimizer of `jaxembed.optim` with
its options (weight decay modes, initial accumulators, eps, FTRL's l1/l2/beta/power) and a
learning-rate schedule, one case each."""

from jaxembed.optim import formulas


def formula_cases(schedule):
    """`{case name: RowFormula}`, the schedules driven by `schedule` (an optax schedule)."""
    return {
        "sgd": formulas.sgd(0.1),
        "sgd_wd": formulas.sgd(0.1, weight_decay=0.05),
        "sgd_schedule": formulas.sgd(schedule),
        "adagrad": formulas.adagrad(0.1),  # optax's: s from 0.1, eps 1e-7 inside the root
        "adagrad_init_eps": formulas.adagrad(0.1, initial_accumulator_value=0.0, eps=1e-3),
        "adagrad_schedule": formulas.adagrad(schedule, initial_accumulator_value=0.5, eps=0.0),
        "fbgemm_adagrad": formulas.fbgemm_adagrad(0.1),  # s from 0, eps 1e-8 outside
        "fbgemm_adagrad_init_eps": formulas.fbgemm_adagrad(
            0.1, initial_accumulator_value=0.1, eps=1e-3
        ),
        "rowwise_adagrad": formulas.rowwise_adagrad(0.1),
        "rowwise_adagrad_l2": formulas.rowwise_adagrad(0.1, weight_decay=0.05, eps=1e-4),
        "rowwise_adagrad_decoupled": formulas.rowwise_adagrad(
            0.1, weight_decay=0.05, weight_decay_mode="decoupled"
        ),
        "rowwise_adagrad_schedule": formulas.rowwise_adagrad(
            schedule, initial_accumulator_value=0.5
        ),
        "adam": formulas.adam(0.01),
        "adam_wd_b1_0": formulas.adam(0.01, b1=0.0, b2=0.5, eps=1e-3, weight_decay=0.05),
        "adam_schedule": formulas.adam(schedule),
        "partial_rowwise_adam": formulas.partial_rowwise_adam(0.01),
        "partial_rowwise_adam_wd": formulas.partial_rowwise_adam(
            0.01, b1=0.5, b2=0.9, weight_decay=0.05
        ),
        "ftrl": formulas.ftrl(0.1),
        "ftrl_l1_l2_beta": formulas.ftrl(0.1, l1=0.5, l2=0.1, beta=0.5),
        "ftrl_power": formulas.ftrl(
            0.1, learning_rate_power=-0.3, l1=0.01, initial_accumulator_value=0.0
        ),
        "ftrl_fixed_rate": formulas.ftrl(0.1, learning_rate_power=0.0, l2=1.0),
        "ftrl_schedule": formulas.ftrl(schedule, l1=0.01),
    }
