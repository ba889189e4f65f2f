package ai.aglstream.client;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;

/** A command line of `--name value` options and positional arguments, nothing more. */
final class Args {
    final List<String> positional = new ArrayList<>();
    private final Map<String, String> options = new HashMap<>();

    Args(String[] argv, int from, Set<String> known) {
        for (int i = from; i < argv.length; i++) {
            String arg = argv[i];
            if (arg.startsWith("--")) {
                if (!known.contains(arg)) {
                    throw new IllegalArgumentException("unknown option " + arg + "; known: " + known);
                }
                if (i + 1 >= argv.length) {
                    throw new IllegalArgumentException(arg + " needs a value");
                }
                options.put(arg, argv[++i]);
            } else {
                positional.add(arg);
            }
        }
    }

    String option(String name, String fallback) {
        return options.getOrDefault(name, fallback);
    }

    String option(String name) {
        return options.get(name);
    }

    double number(String name, double fallback) {
        String value = options.get(name);
        if (value == null) {
            return fallback;
        }
        try {
            return Double.parseDouble(value);
        } catch (NumberFormatException e) {
            throw new IllegalArgumentException(name + " must be a number, got " + value);
        }
    }
}
