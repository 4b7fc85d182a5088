// A Curator lock client for the ZooKeeper tests: the reference implementation of the
// recipes tower-lock's ZooKeeper backend must interoperate with, run as a child process
// by tests/it/common/curator.rs (which compiles this file with javac).
//
//   java CuratorLock [--session-ms N] [--connection-ms N] <connect> <path> <command> ...
//
// Commands:
//   hammer <mutex|write|read> <iterations> <counter-file>
//       Per iteration: take the lock, read the integer in the counter file, sleep 1 ms,
//       write it + 1 (`read`: only read it), release. Ends with `done <iterations>`.
//   hold <mutex|write|read|semaphore:<max>>
//       Take the lock, then wait for a line `release` on stdin, release, exit 0.
//   wait <mutex|write|read|semaphore:<max>>
//       Block in acquire; as soon as it returns, release and exit 0.
//
// Output: one line per event on stdout, `<word> <epoch micros> [detail]`, flushed:
//   acquired <t>      t taken right after the acquire call returned
//   released <t> <t2> t taken right before the release call (the moment the holder lets
//                     go: another client's wake-up delay counts from it), t2 once it has
//                     returned (the line is printed then)
//   lost <t> <STATE>  the connection went SUSPENDED or LOST (any command)
//   reconnected <t>   the connection came back after one of those
//   done <n>          hammer finished n iterations
// An error is printed to stderr and the process exits 1. Logging is off (slf4j-nop on
// the classpath), so stdout carries only these lines.

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Instant;
import java.time.temporal.ChronoUnit;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.framework.state.ConnectionState;
import org.apache.curator.retry.ExponentialBackoffRetry;

public final class CuratorLock {
    /// A lock in one of the modes, taken and released the same way whatever the recipe.
    private interface Held {
        void release() throws Exception;
    }

    private interface Lock {
        Held acquire() throws Exception;
    }

    public static void main(String[] argv) {
        try {
            System.exit(run(argv));
        } catch (Throwable e) {
            e.printStackTrace();
            System.exit(1);
        }
    }

    private static int run(String[] argv) throws Exception {
        int sessionMs = 10_000;
        int connectionMs = 5_000;
        List<String> args = new ArrayList<>();
        for (int i = 0; i < argv.length; i++) {
            switch (argv[i]) {
                case "--session-ms" -> sessionMs = Integer.parseInt(argv[++i]);
                case "--connection-ms" -> connectionMs = Integer.parseInt(argv[++i]);
                default -> args.add(argv[i]);
            }
        }
        if (args.size() < 4) {
            System.err.println("usage: CuratorLock [--session-ms N] [--connection-ms N] "
                    + "<connect> <path> <hammer|hold|wait> <mode> [iterations counter-file]");
            return 2;
        }
        String connect = args.get(0);
        String path = args.get(1);
        String command = args.get(2);
        String mode = args.get(3);

        CuratorFramework client = CuratorFrameworkFactory.builder()
                .connectString(connect)
                .sessionTimeoutMs(sessionMs)
                .connectionTimeoutMs(connectionMs)
                // Retries with a short backoff, capped at 1 s: an operation outlives a
                // leader election, and a test's deadline is not spent sleeping.
                .retryPolicy(new ExponentialBackoffRetry(50, 29, 1_000))
                // No watch on /zookeeper/config (the tracker follows reconfigurations,
                // which the tests make none of): the only watches a test sees are the
                // lock recipes'.
                .ensembleTracker(false)
                .build();
        client.getConnectionStateListenable().addListener((c, state) -> {
            if (state == ConnectionState.SUSPENDED || state == ConnectionState.LOST) {
                say("lost " + micros() + " " + state);
            } else if (state == ConnectionState.RECONNECTED) {
                say("reconnected " + micros());
            }
        });
        client.start();
        try {
            if (!client.blockUntilConnected(connectionMs, TimeUnit.MILLISECONDS)) {
                System.err.println("not connected to " + connect + " within " + connectionMs + " ms");
                return 1;
            }
            Lock lock = lock(client, path, mode);
            switch (command) {
                case "hammer" -> {
                    if (args.size() != 6) {
                        System.err.println("hammer needs <iterations> <counter-file>");
                        return 2;
                    }
                    hammer(lock, !mode.equals("read"), Integer.parseInt(args.get(4)),
                            Path.of(args.get(5)));
                }
                case "hold" -> hold(lock);
                case "wait" -> once(lock);
                default -> {
                    System.err.println("unknown command " + command);
                    return 2;
                }
            }
        } finally {
            client.close();
        }
        return 0;
    }

    private static Lock lock(CuratorFramework client, String path, String mode) {
        if (mode.startsWith("semaphore:")) {
            int max = Integer.parseInt(mode.substring("semaphore:".length()));
            InterProcessSemaphoreV2 semaphore = new InterProcessSemaphoreV2(client, path, max);
            return () -> {
                Lease lease = semaphore.acquire();
                return () -> semaphore.returnLease(lease);
            };
        }
        InterProcessMutex mutex = switch (mode) {
            case "mutex" -> new InterProcessMutex(client, path);
            case "write" -> new InterProcessReadWriteLock(client, path).writeLock();
            case "read" -> new InterProcessReadWriteLock(client, path).readLock();
            default -> throw new IllegalArgumentException("unknown mode " + mode);
        };
        return () -> {
            mutex.acquire();
            return mutex::release;
        };
    }

    private static void hammer(Lock lock, boolean write, int iterations, Path counter)
            throws Exception {
        for (int i = 0; i < iterations; i++) {
            Held held = lock.acquire();
            say("acquired " + micros());
            long value = Long.parseLong(Files.readString(counter, StandardCharsets.UTF_8).trim());
            Thread.sleep(1);
            if (write) {
                Files.writeString(counter, Long.toString(value + 1), StandardCharsets.UTF_8);
            }
            release(held);
        }
        say("done " + iterations);
    }

    private static void hold(Lock lock) throws Exception {
        Held held = lock.acquire();
        say("acquired " + micros());
        BufferedReader stdin = new BufferedReader(
                new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = stdin.readLine()) != null && !line.trim().equals("release")) {
            // Anything else is ignored.
        }
        if (line == null) {
            throw new IllegalStateException("stdin closed before `release`");
        }
        release(held);
    }

    private static void once(Lock lock) throws Exception {
        Held held = lock.acquire();
        say("acquired " + micros());
        release(held);
    }

    private static void release(Held held) throws Exception {
        long at = micros();
        held.release();
        say("released " + at + " " + micros());
    }

    private static long micros() {
        return ChronoUnit.MICROS.between(Instant.EPOCH, Instant.now());
    }

    private static synchronized void say(String line) {
        System.out.println(line);
        System.out.flush();
    }
}
