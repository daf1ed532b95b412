// test_kernel_lab_harness.cpp — the kernel lab's judging and reporting logic (dev/cuda/harness.h),
// on the CPU: a GPU run trusts these to tell a right kernel from a wrong one.
//   the error metric: passes a correct bf16 / fp32 result; fails a wrong one, one NaN, one element
//   left unwritten (poison), a single wrong element hiding under the L2 bound, an all-zero reference
//   the median, the number of rotation slots and of repeats; the table's formatting; the command line;
//   the random inputs (reproducible from the seed, never zero, bf16-rounded exactly)
#include <cstdio>
#include "dev/cuda/harness.h"
#include "test/checks.h"

// the bits a GPU would leave for these values, in bf16
static std::vector<uint16_t> as_bf16(const std::vector<float>& v) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); i++) b[i] = float_to_bf16_round_nearest(v[i]);
    return b;
}

int main() {
    const size_t n = 100000;
    std::vector<float> ref = random_normal(n, 42, 0.0f, 1.0f);

    // --- the error metric
    ErrorStats s = compare_output(as_bf16(ref).data(), DT_BF16, ref.data(), n);
    check(s.pass && s.rel_l2 > 1e-3 && s.rel_l2 < 2.5e-3, "bf16 rounding of the right answer passes, error ~1.6e-3",
          strprintf("rel %.2e: %s", s.rel_l2, s.why.c_str()));
    s = compare_output(ref.data(), DT_F32, ref.data(), n);
    check(s.pass && s.rel_l2 == 0, "an exact fp32 answer passes with zero error", s.why);

    std::vector<float> wrong = ref;
    for (size_t i = 0; i < n; i += 2) wrong[i] *= 1.05f;  // a 5% error in half the elements
    s = compare_output(as_bf16(wrong).data(), DT_BF16, ref.data(), n);
    check(!s.pass && s.why.find("relative error") != std::string::npos, "a wrong result fails", s.why);

    std::vector<float> perturbed = ref;
    for (float& x : perturbed) x *= 1.0f + 3e-5f;  // fine for bf16, far too much for fp32
    s = compare_output(perturbed.data(), DT_F32, ref.data(), n);
    check(!s.pass, "fp32 has the tighter bound (3e-5 relative fails)", strprintf("rel %.2e", s.rel_l2));

    std::vector<uint16_t> bits = as_bf16(ref);
    bits[777] = float_to_bf16_round_nearest(NAN);  // a NaN the kernel computed
    s = compare_output(bits.data(), DT_BF16, ref.data(), n);
    check(!s.pass && s.not_finite == 1 && s.unwritten == 0, "one computed NaN fails", s.why);

    bits = as_bf16(ref);
    bits[n - 1] = 0xFFFF;  // the poison pattern: never written
    s = compare_output(bits.data(), DT_BF16, ref.data(), n);
    check(!s.pass && s.unwritten == 1 && s.not_finite == 0, "one unwritten (poisoned) bf16 element fails", s.why);
    std::vector<float> out32 = ref;
    uint32_t poison32 = 0xFFFFFFFFu;
    memcpy(&out32[5], &poison32, 4);
    s = compare_output(out32.data(), DT_F32, ref.data(), n);
    check(!s.pass && s.unwritten == 1, "one unwritten (poisoned) fp32 element fails", s.why);
    unsigned char poison_bytes[4];
    memset(poison_bytes, POISON_BYTE, 4);
    float poison_value;
    memcpy(&poison_value, poison_bytes, 4);
    check(std::isnan(poison_value) && std::isnan(bf16_to_float(0xFFFF)) && float_to_bf16_round_nearest(NAN) != 0xFFFF,
          "the poison byte makes NaNs in both types, distinct from a computed NaN");

    bits = as_bf16(ref);
    size_t big = 0;
    for (size_t i = 0; i < n; i++) big = std::fabs(ref[i]) > std::fabs(ref[big]) ? i : big;
    bits[big] = float_to_bf16_round_nearest(0.5f * ref[big]);  // one element (the largest) half wrong: small in L2
    s = compare_output(bits.data(), DT_BF16, ref.data(), n);
    check(!s.pass && s.rel_l2 < error_bound(DT_BF16) && s.why.find("max abs") != std::string::npos,
          "one wrong element under the L2 bound fails the max-abs rule", s.why);

    std::vector<float> zeros(n, 0.0f);
    s = compare_output(zeros.data(), DT_F32, zeros.data(), n);
    check(!s.pass, "an all-zero reference proves nothing and fails", s.why);
    std::vector<float> bad_ref = ref;
    bad_ref[3] = NAN;
    s = compare_output(ref.data(), DT_F32, bad_ref.data(), n);
    check(!s.pass && s.bad_reference == 1, "a NaN in the reference fails (a broken test)", s.why);
    s = compare_output(ref.data(), DT_F32, ref.data(), 0);
    check(!s.pass, "an empty comparison fails", s.why);

    // --- times
    check(median({5, 1, 3}) == 3 && median({4, 1, 3, 2}) == 2.5 && std::isnan(median({})), "median");
    check(median({1, 1, 1, 1, 100}) == 1, "the median ignores an outlier launch");
    check(rotation_slots(25e6, 50e6) == 6 && rotation_slots(1e9, 50e6) == 1 && rotation_slots(1e3, 50e6) == 8,
          "rotation slots span 3x the L2, between 1 and 8",
          strprintf("%d %d %d", rotation_slots(25e6, 50e6), rotation_slots(1e9, 50e6), rotation_slots(1e3, 50e6)));
    check(timed_repeats(0.01) == 100 && timed_repeats(100) == 5 && timed_repeats(10) == 30, "repeats: ~300 ms, 5 to 100");

    // --- the table
    Row r;
    r.kernel = "gelu_forward";
    r.version = 3;
    r.name = "trainer: 16-byte vectors";
    r.ms = 0.05;
    r.bytes = 100e6;
    r.ceilings = {2500, 600};
    r.rel_l2 = 1.6e-3;
    r.max_abs = 7.8e-3;
    r.status = "PASS";
    std::string row = table_row(r);
    check(row.find("| gelu_forward ") == 0 && row.find("3 trainer: 16-byte vectors") != std::string::npos &&
              row.find("50.0 us") != std::string::npos && row.find("2000 GB/s") != std::string::npos &&
              row.find("80.0%") != std::string::npos && row.find("1.6e-03") != std::string::npos &&
              row.find("| PASS   |") != std::string::npos,
          "a memory-bound row: time, GB/s, % of the copy ceiling, error, status", row);
    r.flops = 300e9;  // 300 GFLOP in 1 ms = 300 TFLOP/s, half the GEMM ceiling; the bytes' floor is lower
    r.ms = 1.0;
    row = table_row(r);
    check(row.find("300.0 TFLOP/s") != std::string::npos && row.find("50.0%") != std::string::npos,
          "a compute-bound row: TFLOP/s, % of the GEMM ceiling", row);
    std::string header = table_header();
    auto bars = [](const std::string& line) { return std::count(line.begin(), line.end(), '|'); };
    check(bars(header.substr(0, header.find('\n'))) == bars(row) && bars(row) == 9, "header and rows have 8 columns");
    check(format_time(250) == "250 ms" && format_time(2.5) == "2.50 ms" && format_time(0.0123) == "12.3 us" &&
              format_time(NAN) == "-",
          "time formats");
    Row skipped;
    skipped.status = "SKIP";
    check(format_achieved(skipped) == "-" && format_percent(skipped) == "-", "an untimed row shows dashes");

    // --- the command line
    LabArgs a;
    std::string err;
    const char* argv1[] = {"prog", "--small", "3", "--version", "1", "--kernel", "gelu_backward", "--seed", "7"};
    bool ok = parse_lab_args(9, (char**)argv1, &a, &err);
    check(ok && a.small && a.seed == 7 && a.versions == std::vector<int>({3, 1}) && a.kernel == "gelu_backward",
          "flags and bare version numbers parse", err);
    check(lab_selected(a, "gelu_backward", 3) && !lab_selected(a, "gelu_backward", 2) && !lab_selected(a, "gelu_forward", 3),
          "selection by kernel and version");
    LabArgs none;
    check(lab_selected(none, "anything", 9), "no selection runs everything");
    const char* argv2[] = {"prog", "--batch"};
    LabArgs b;
    check(!parse_lab_args(2, (char**)argv2, &b, &err) && err.find("--batch") != std::string::npos, "a flag without value fails", err);
    const char* argv3[] = {"prog", "--batch", "0"};
    check(!parse_lab_args(3, (char**)argv3, &b, &err), "--batch 0 is refused", err);
    const char* argv4[] = {"prog", "--fast"};
    check(!parse_lab_args(2, (char**)argv4, &b, &err) && err.find("--fast") != std::string::npos, "an unknown flag fails", err);
    const char* argv5[] = {"prog", "--tiny", "--check-only"};
    LabArgs t;
    check(parse_lab_args(3, (char**)argv5, &t, &err) && t.tiny && t.check_only && !t.small, "--tiny and --check-only parse", err);
    const char* argv6[] = {"prog", "--tiny", "--small"};
    check(!parse_lab_args(3, (char**)argv6, &b, &err) && err.find("choose one") != std::string::npos,
          "--tiny with --small is refused", err);

    // --- the digest of an output's bits: one flipped bit anywhere changes it
    std::vector<float> copy = ref;
    uint64_t digest = bits_digest(ref.data(), ref.size() * 4);
    bool all_change = true;
    for (size_t i : {(size_t)0, ref.size() / 2, ref.size() - 1}) {
        copy[i] = std::nextafter(ref[i], INFINITY);
        all_change &= bits_digest(copy.data(), copy.size() * 4) != digest;
        copy[i] = ref[i];
    }
    check(all_change && bits_digest(copy.data(), copy.size() * 4) == digest, "the bits digest sees one changed ulp");

    // --- random inputs
    std::vector<float> again = random_normal(n, 42, 0.0f, 1.0f), other = random_normal(n, 43, 0.0f, 1.0f);
    check(again == ref && other != ref, "inputs are a function of the seed");
    size_t zero_count = 0;
    double sum = 0, sum2 = 0;
    for (float x : ref) {
        zero_count += x == 0.0f;
        sum += x;
        sum2 += (double)x * x;
    }
    check(zero_count == 0 && std::fabs(sum / n) < 0.02 && std::fabs(sum2 / n - 1) < 0.02, "normal inputs: never zero, mean 0, variance 1");
    std::vector<float> u = random_uniform(n, 5, 2.0f, 3.0f);
    check(*std::min_element(u.begin(), u.end()) > 2.0f && *std::max_element(u.begin(), u.end()) < 3.0f, "uniform inputs in range");
    std::vector<float> rounded = ref;
    round_to_bf16(&rounded);
    bool exact = true;
    for (size_t i = 0; i < n; i++) exact &= bf16_to_float(float_to_bf16_round_nearest(rounded[i])) == rounded[i];
    check(exact && rounded != ref, "round_to_bf16 leaves values a bf16 holds exactly");
    check(fresh_seed() != fresh_seed(), "fresh seeds differ between runs");
    return check_exit_code();
}
