/* The emulated card, read once from the environment (autotune/emulation/environment.py writes it from
 * the card catalog), and the one-line log both stand-in libraries write to stderr.
 *
 * Every variable is required: a card half described would answer some queries with zeros, and torch
 * would decide on them silently. A missing or malformed one is named in one line, and every device
 * query then fails with cudaErrorInitializationError (3).
 */
#ifndef AUTOTUNE_EMULATION_CARD_H
#define AUTOTUNE_EMULATION_CARD_H

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define AT_LOG_PREFIX "autotune-emulation: "

struct at_card {
    char name[256];
    unsigned long long total_bytes;
    long major, minor, sm_count;
    long l2_bytes, bus_width_bits;
    long max_threads_per_sm, max_blocks_per_sm, max_threads_per_block, warp_size;
    long shared_per_sm, shared_per_block, shared_per_block_optin, shared_reserved_per_block;
    long registers_per_sm, registers_per_block, constant_bytes;
    long driver_version;
    int ok;
};

static struct at_card at_card_value;
static pthread_once_t at_card_once = PTHREAD_ONCE_INIT;

/* One line to stderr in one write(2), so that lines from threads never interleave. */
static void at_log(const char *format, ...) {
    char line[512];
    size_t prefix = sizeof(AT_LOG_PREFIX) - 1;
    memcpy(line, AT_LOG_PREFIX, prefix);
    va_list args;
    va_start(args, format);
    int n = vsnprintf(line + prefix, sizeof(line) - prefix - 1, format, args);
    va_end(args);
    size_t length = prefix + (n < 0 ? 0 : (size_t)n);
    if (length > sizeof(line) - 2) length = sizeof(line) - 2;
    line[length++] = '\n';
    ssize_t ignored = write(2, line, length);
    (void)ignored;
}

static int at_number(const char *variable, unsigned long long *out) {
    const char *text = getenv(variable);
    if (text == NULL || *text == '\0') {
        at_log("%s is not set: the card's variables come from autotune.emulation.card_environment", variable);
        return 0;
    }
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    if (end == text || *end != '\0') {
        at_log("%s=%s is not a non-negative integer", variable, text);
        return 0;
    }
    *out = value;
    return 1;
}

static void at_card_read(void) {
    struct at_card *card = &at_card_value;
    const char *name = getenv("AUTOTUNE_EMULATED_NAME");
    int ok = 1;
    if (name == NULL || *name == '\0') {
        at_log("AUTOTUNE_EMULATED_NAME is not set: the card's variables come from autotune.emulation.card_environment");
        ok = 0;
    } else {
        snprintf(card->name, sizeof(card->name), "%s", name);
    }
    unsigned long long value = 0;
#define AT_READ(field, variable) \
    if (at_number("AUTOTUNE_EMULATED_" variable, &value)) card->field = (long)value; else ok = 0;
    if (at_number("AUTOTUNE_EMULATED_TOTAL_BYTES", &value)) card->total_bytes = value; else ok = 0;
    AT_READ(major, "CC_MAJOR")
    AT_READ(minor, "CC_MINOR")
    AT_READ(sm_count, "SM_COUNT")
    AT_READ(l2_bytes, "L2_BYTES")
    AT_READ(bus_width_bits, "BUS_WIDTH_BITS")
    AT_READ(max_threads_per_sm, "MAX_THREADS_PER_SM")
    AT_READ(max_blocks_per_sm, "MAX_BLOCKS_PER_SM")
    AT_READ(max_threads_per_block, "MAX_THREADS_PER_BLOCK")
    AT_READ(warp_size, "WARP_SIZE")
    AT_READ(shared_per_sm, "SHARED_PER_SM")
    AT_READ(shared_per_block, "SHARED_PER_BLOCK")
    AT_READ(shared_per_block_optin, "SHARED_PER_BLOCK_OPTIN")
    AT_READ(shared_reserved_per_block, "SHARED_RESERVED_PER_BLOCK")
    AT_READ(registers_per_sm, "REGISTERS_PER_SM")
    AT_READ(registers_per_block, "REGISTERS_PER_BLOCK")
    AT_READ(constant_bytes, "CONSTANT_BYTES")
    AT_READ(driver_version, "DRIVER_VERSION")
#undef AT_READ
    card->ok = ok;
}

static const struct at_card *at_card(void) {
    pthread_once(&at_card_once, at_card_read);
    return &at_card_value;
}

/* Whether name is listed in AUTOTUNE_EMULATION_DISABLE (comma-separated): an emulated entry point
 * then answers as one the emulation does not cover, which is how the tests make a runtime fail. */
static int at_disabled(const char *name) {
    const char *list = getenv("AUTOTUNE_EMULATION_DISABLE");
    if (list == NULL) return 0;
    size_t length = strlen(name);
    for (const char *at = strstr(list, name); at != NULL; at = strstr(at + 1, name)) {
        int starts = at == list || at[-1] == ',';
        int ends = at[length] == '\0' || at[length] == ',';
        if (starts && ends) return 1;
    }
    return 0;
}

/* The first call of an entry point the emulation does not cover logs it; later calls are quiet. */
static void at_not_emulated_once(const char *name, int *logged) {
    if (!__atomic_exchange_n(logged, 1, __ATOMIC_RELAXED))
        at_log("%s is not emulated: it was called and failed (operation not supported)", name);
}

#endif
