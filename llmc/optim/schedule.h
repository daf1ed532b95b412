// schedule.h — the learning rate as a function of the step.
//
// Every schedule starts with a linear warmup: Adam's second-moment estimate is poor in the first
// steps, and full-size updates from it can throw a fresh network into a bad region. After warmup:
//
//   cosine    lr_min + (lr_max - lr_min) * (1 + cos(pi * p)) / 2       p = progress in [0, 1]
//   linear    lr_max - (lr_max - lr_min) * p
//   constant  lr_max
//   wsd       warmup-stable-decay: lr_max until the last `decay_fraction` of the steps, then linear
//             to lr_min. The stable phase can be extended without knowing the run's length in
//             advance, and any stable-phase checkpoint can be "cooled down" into a finished model.
//
// lr_min = final_lr_fraction * lr_max. Steps count from 0; step s uses learning_rate(s).
#pragma once

#include <cmath>
#include <string>
#include "llmc/utils.h"

enum class LRSchedule { Cosine, Linear, Constant, WSD };

inline bool parse_lr_schedule(const std::string& name, LRSchedule* out) {
    if (name == "cosine") *out = LRSchedule::Cosine;
    else if (name == "linear") *out = LRSchedule::Linear;
    else if (name == "constant") *out = LRSchedule::Constant;
    else if (name == "wsd") *out = LRSchedule::WSD;
    else return false;
    return true;
}

struct ScheduleConfig {
    LRSchedule kind = LRSchedule::Cosine;
    float max_lr = 6e-4f;
    int warmup_steps = 0;
    int total_steps = 1;
    float final_lr_fraction = 0.0f;   // lr_min / lr_max
    float decay_fraction = 0.2f;      // wsd only: share of the steps spent decaying
};

inline float learning_rate(const ScheduleConfig& s, int step) {
    if (step < s.warmup_steps) return s.max_lr * (float)(step + 1) / (float)s.warmup_steps;
    float min_lr = s.final_lr_fraction * s.max_lr;
    int decay_steps = s.total_steps - s.warmup_steps;
    float progress = decay_steps > 1 ? (float)(step - s.warmup_steps) / (float)(decay_steps - 1) : 1.0f;
    progress = std::fmin(std::fmax(progress, 0.0f), 1.0f);
    switch (s.kind) {
        case LRSchedule::Constant:
            return s.max_lr;
        case LRSchedule::Linear:
            return s.max_lr - (s.max_lr - min_lr) * progress;
        case LRSchedule::Cosine:
            return min_lr + (s.max_lr - min_lr) * 0.5f * (1.0f + std::cos(3.14159265358979f * progress));
        case LRSchedule::WSD: {
            int decay_len = (int)std::lround(s.decay_fraction * s.total_steps);
            int decay_start = s.total_steps - decay_len;
            if (step < decay_start || decay_len <= 0) return s.max_lr;
            float p = decay_len > 1 ? (float)(step - decay_start) / (float)(decay_len - 1) : 1.0f;
            return s.max_lr - (s.max_lr - min_lr) * std::fmin(p, 1.0f);
        }
    }
    return s.max_lr;
}
