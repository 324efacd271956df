// The job ledger from Java with pgjdbc (plain JDBC, no framework): the
// ledger's whole API is SQL functions, so any client that can run a query can
// use it. Build and run (Debian: default-jdk-headless, libpostgresql-jdbc-java):
//
//   javac -d build Run.java
//   LEDGER_DSN=postgres://user@host:5432/db java -cp build:/usr/share/java/postgresql.jar Run run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]
//   ... Run zombie <job> <owner> <run_id> <token>   # a fenced write with an old token
//   ... Run tokens <job> <owner> [count]            # tokens as long, not as strings
//   ... Run guarded <job> <owner>                   # CALL ledger.run_guarded inside a transaction, then in autocommit
//   ... Run worker <job> <owner> [--ttl=...]        # a long-lived worker: one run per line read on stdin
//
// LEDGER_DSN is a postgres:// URI (the other examples' format); it becomes a
// jdbc:postgresql:// URL, its query parameters passed on as pgjdbc
// properties. Without LEDGER_DSN, PGHOST, PGPORT, PGUSER, PGPASSWORD and
// PGDATABASE are read (pgjdbc does not read them itself). pgjdbc speaks TCP
// only: a Unix-socket host is refused.
//
// BEHIND A TRANSACTION POOLER (PgBouncer pool_mode=transaction) add
// prepareThreshold=0 to the URL. With the default (5), pgjdbc prepares COMMIT
// and ROLLBACK as *named* server-side statements (S_1, S_2, ...) on first use
// and later sends only "execute S_1". The pooler may run that on a server
// connection where S_1 is another client's ROLLBACK: the transaction -- fence
// and write -- is rolled back, and commit() returns normally. No error
// anywhere, the write is lost (tests/drivers/test_pgjdbc_lost_write.py shows it).
// prepareThreshold=0 sends every statement unnamed, in one round trip.
// PgBouncer must also ignore the startup parameter pgjdbc sends:
// ignore_startup_parameters = extra_float_digits.
//
// Each mode prints one JSON line saying what happened (worker: one per run).
// `run`, `zombie` and `worker` write into a table the caller created:
//   CREATE TABLE fenced_writes (token bigint, written_by text)

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.net.URI;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.ResultSet;
import java.sql.SQLException;
import java.sql.Types;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.TimeoutException;

import org.postgresql.util.PSQLException;
import org.postgresql.util.ServerErrorMessage;

public final class Run {
    static final String TABLE_INSERT = "INSERT INTO fenced_writes (token, written_by) VALUES (?, ?)";

    // The fence's resource name. Tokens count per job, so a resource belongs
    // to the first job that fenced it (another job gets LD006): one per job.
    static String resourceOf(String job) {
        return "fenced_writes:" + job;
    }

    // ---- connecting -------------------------------------------------------

    static Connection connect() throws SQLException {
        Properties props = new Properties();
        props.setProperty("ApplicationName", "ledger-java-example");
        String url = jdbcUrl(System.getenv("LEDGER_DSN"), props);
        Connection conn = DriverManager.getConnection(url, props);
        // Autocommit (JDBC's default, said here because it matters): every
        // ledger call is its own transaction, committed when it returns.
        // Only the fenced write turns it off, for its one transaction.
        conn.setAutoCommit(true);
        return conn;
    }

    // postgres://user:password@host:port/db?k=v -> jdbc:postgresql://host:port/db,
    // user and password as properties, k=v as properties (prepareThreshold=0, ...).
    static String jdbcUrl(String dsn, Properties props) {
        if (dsn == null || dsn.isEmpty()) {
            String host = envOr("PGHOST", "localhost");
            if (host.startsWith("/")) throw new IllegalArgumentException("pgjdbc cannot use a Unix socket (PGHOST=" + host + ")");
            props.setProperty("user", envOr("PGUSER", System.getProperty("user.name")));
            if (System.getenv("PGPASSWORD") != null) props.setProperty("password", System.getenv("PGPASSWORD"));
            return "jdbc:postgresql://" + host + ":" + envOr("PGPORT", "5432") + "/" + envOr("PGDATABASE", props.getProperty("user"));
        }
        URI uri = URI.create(dsn);
        if (!"postgres".equals(uri.getScheme()) && !"postgresql".equals(uri.getScheme())) {
            throw new IllegalArgumentException("LEDGER_DSN must be a postgres:// URI");
        }
        if (uri.getRawUserInfo() != null) {
            String[] auth = uri.getRawUserInfo().split(":", 2);
            props.setProperty("user", decode(auth[0]));
            if (auth.length == 2) props.setProperty("password", decode(auth[1]));
        }
        if (uri.getRawQuery() != null) {
            for (String pair : uri.getRawQuery().split("&")) {
                String[] kv = pair.split("=", 2);
                String key = decode(kv[0]);
                if (key.equals("host") || key.equals("port")) throw new IllegalArgumentException("pgjdbc: put host and port before the path, not in ?" + key + "=");
                props.setProperty(key, kv.length == 2 ? decode(kv[1]) : "");
            }
        }
        if (uri.getHost() == null) throw new IllegalArgumentException("pgjdbc needs a TCP host in LEDGER_DSN (no Unix socket)");
        String host = uri.getHost().contains(":") && !uri.getHost().startsWith("[") ? "[" + uri.getHost() + "]" : uri.getHost();
        return "jdbc:postgresql://" + host + ":" + (uri.getPort() < 0 ? 5432 : uri.getPort()) + uri.getRawPath();
    }

    static String envOr(String name, String fallback) {
        String value = System.getenv(name);
        return value == null || value.isEmpty() ? fallback : value;
    }

    static String decode(String s) {
        return URLDecoder.decode(s.replace("+", "%2B"), StandardCharsets.UTF_8);
    }

    // ---- errors -----------------------------------------------------------

    // The ledger's errors: getSQLState() is the SQLSTATE (LD001..LD006 for the
    // ledger's own, 22004 for a NULL argument, 22023 for an invalid one) and
    // the server's DETAIL, a JSON object of facts (job, token, current_token,
    // holder, ...), is in getServerErrorMessage().getDetail(). It is printed
    // here as it came (jsonb's own text: nothing re-encodes it, so no number
    // is rounded). To read a token out of it, use a parser that keeps JSON
    // integers as long: Jackson's readTree(detail).get("current_token").asLong()
    // is exact; Gson into a Map<String, Object> makes every number a double.
    static Map<String, Object> describe(Throwable err) {
        Map<String, Object> out = new LinkedHashMap<>();
        if (err instanceof PSQLException && ((PSQLException) err).getServerErrorMessage() != null) {
            ServerErrorMessage msg = ((PSQLException) err).getServerErrorMessage();
            String detail = msg.getDetail();
            out.put("code", msg.getSQLState());
            out.put("message", msg.getMessage());
            out.put("detail", detail != null && detail.startsWith("{") && detail.endsWith("}") ? new Json.Raw(detail) : detail);
        } else {
            out.put("code", err instanceof SQLException ? ((SQLException) err).getSQLState() : null);
            out.put("message", String.valueOf(err.getMessage()));
            out.put("detail", null);
        }
        return out;
    }

    // Tokens and run ids are bigint (int8): read them with getLong and send
    // them with setLong, a Java long being exactly a 64-bit int8. Never as a
    // double (exact only to 2^53: tokens jump by 2^32 at each promotion), and
    // never compare their text ("10" < "9"). JSON output gets their decimal
    // string, as the other examples print it.
    static String token(ResultSet rs, String column) throws SQLException {
        long value = rs.getLong(column);
        return rs.wasNull() ? null : Long.toString(value);
    }

    // ---- the fenced write -------------------------------------------------

    // One transaction holds the fence and the application's write: they
    // commit together or not at all. The fence raises LD001 when `token` is
    // no longer the job's live token (it expired, or another runner took
    // over), LD002 when a newer token already wrote to the resource, LD006
    // when the resource belongs to another job; then the INSERT never commits.
    static void fencedWrite(Connection conn, String job, String resource, long token, String writtenBy) throws SQLException {
        conn.setAutoCommit(false); // pgjdbc sends BEGIN before the next statement
        try {
            try (PreparedStatement fence = conn.prepareStatement("SELECT ledger.fence(job => ?, resource => ?, token => ?)")) {
                fence.setString(1, job);
                fence.setString(2, resource);
                fence.setLong(3, token);
                fence.executeQuery().close();
            }
            try (PreparedStatement insert = conn.prepareStatement(TABLE_INSERT)) {
                insert.setLong(1, token);
                insert.setString(2, writtenBy);
                insert.executeUpdate();
            }
            conn.commit();
        } catch (SQLException err) {
            conn.rollback();
            throw err;
        } finally {
            conn.setAutoCommit(true);
        }
    }

    // ---- run --------------------------------------------------------------

    static Map<String, Object> runMode(Connection ledger, Connection app, String job, String owner, Map<String, String> opts) throws Exception {
        String resource = opts.getOrDefault("resource", resourceOf(job));
        long ttlSeconds = Long.parseLong(opts.getOrDefault("ttl", "30"));
        long workMs = Long.parseLong(opts.getOrDefault("work-ms", "0"));
        Map<String, Object> result = new LinkedHashMap<>();
        result.put("mode", "run");
        result.put("job", job);
        result.put("owner", owner);
        result.put("outcome", null);
        result.put("run_id", null);
        result.put("token", null);
        result.put("wrote", false);
        result.put("heartbeats", 0);
        result.put("error", null);

        // Named notation: the contract names every argument, so a call keeps
        // working when optional arguments are added. setString types its
        // value as varchar, and there is no cast from varchar to interval:
        // hence ?::interval (or connect with stringtype=unspecified).
        long runId;
        long token;
        try (PreparedStatement st = ledger.prepareStatement(
                "SELECT outcome, run_id, token, holder, holder_expires_at FROM ledger.start_run("
                + "job => ?, owner => ?, ttl => ?::interval, idempotency_key => ?)")) {
            st.setString(1, job);
            st.setString(2, owner);
            st.setString(3, ttlSeconds + " seconds");
            if (opts.containsKey("key")) st.setString(4, opts.get("key"));
            else st.setNull(4, Types.VARCHAR);
            try (ResultSet rs = st.executeQuery()) {
                rs.next();
                String outcome = rs.getString("outcome");
                result.put("outcome", outcome);
                switch (outcome) {
                    case "started":
                        break;
                    case "skipped_overlap": // another owner's lease is live: not a failure, try at the next tick
                        result.put("holder", rs.getString("holder"));
                        // OffsetDateTime keeps the server's microseconds (java.sql.Timestamp would too;
                        // java.util.Date would not).
                        OffsetDateTime until = rs.getObject("holder_expires_at", OffsetDateTime.class);
                        result.put("holder_expires_at", until == null ? null : iso(until));
                        return result;
                    case "already_done": // this slot or idempotency key already succeeded (or is running)
                    case "paused": // the job is paused: do nothing
                        return result;
                    default:
                        throw new IllegalStateException("unexpected outcome " + outcome);
                }
                runId = rs.getLong("run_id");
                token = rs.getLong("token");
            }
        }
        result.put("run_id", Long.toString(runId));
        result.put("token", Long.toString(token));

        // Heartbeat every ttl/3 on the ledger connection, from a thread of its
        // own: two beats may be lost before the lease expires. NULL means the
        // lease is lost (expired and taken over, or reaped): stop working,
        // nothing we write from now on would be accepted anyway. The
        // application's transaction runs on the other connection: a heartbeat
        // must never land inside it (its lease update would stay invisible,
        // and be rolled back with it) nor queue behind a slow query.
        CompletableFuture<Throwable> lost = new CompletableFuture<>();
        int[] beats = {0};
        ScheduledExecutorService timer = Executors.newSingleThreadScheduledExecutor();
        long period = ttlSeconds * 1000 / 3;
        timer.scheduleAtFixedRate(() -> {
            if (lost.isDone()) return;
            try (PreparedStatement hb = ledger.prepareStatement("SELECT ledger.heartbeat(run_id => ?, token => ?) AS expires_at")) {
                hb.setLong(1, runId);
                hb.setLong(2, token);
                try (ResultSet rs = hb.executeQuery()) {
                    rs.next();
                    if (rs.getObject("expires_at") == null) lost.complete(new IllegalStateException("lease lost: heartbeat returned NULL"));
                    else beats[0] += 1;
                }
            } catch (SQLException err) {
                lost.complete(err); // LD001/LD003: the run is no longer ours
            }
        }, period, period, TimeUnit.MILLISECONDS);

        try {
            try {
                Throwable why = lost.get(workMs, TimeUnit.MILLISECONDS); // the job's real work goes here
                result.put("error", describe(why)); // the heartbeat says the lease is lost: why
            } catch (TimeoutException workDone) {
                fencedWrite(app, job, resource, token, owner);
                result.put("wrote", true);
            }
        } catch (SQLException err) {
            result.put("error", describe(err)); // any failure of the work fails the run
        } finally {
            timer.shutdown();
            timer.awaitTermination(1, TimeUnit.MINUTES); // let a heartbeat in flight finish before the run ends
            result.put("heartbeats", beats[0]);
        }

        // End the run: this also releases the lease. A zombie learns here too
        // that it lost (LD001: a newer token took over; LD003: already closed).
        try {
            @SuppressWarnings("unchecked")
            Map<String, Object> error = (Map<String, Object>) result.get("error");
            String sql = error == null
                ? "SELECT run_id FROM ledger.complete_run(run_id => ?, token => ?)"
                : "SELECT run_id FROM ledger.fail_run(run_id => ?, token => ?, error => ?)";
            try (PreparedStatement end = ledger.prepareStatement(sql)) {
                end.setLong(1, runId);
                end.setLong(2, token);
                if (error != null) {
                    end.setString(3, (error.get("code") == null ? "error" : error.get("code")) + ": " + error.get("message"));
                }
                end.executeQuery().close();
            }
        } catch (SQLException err) {
            result.put("end_error", describe(err));
        }
        return result;
    }

    // ---- zombie -----------------------------------------------------------

    // A process that slept through its lease wakes up and writes with the
    // token it had. The fence refuses it (LD001) and its row is rolled back;
    // ending the run is refused as well.
    static Map<String, Object> zombieMode(Connection conn, String job, String owner, long runId, long token) {
        Map<String, Object> result = new LinkedHashMap<>();
        result.put("mode", "zombie");
        result.put("job", job);
        result.put("owner", owner);
        result.put("run_id", Long.toString(runId));
        result.put("token", Long.toString(token));
        result.put("wrote", false);
        result.put("error", null);
        try {
            fencedWrite(conn, job, resourceOf(job), token, owner);
            result.put("wrote", true);
        } catch (SQLException err) {
            result.put("error", describe(err));
        }
        try (PreparedStatement end = conn.prepareStatement("SELECT run_id FROM ledger.complete_run(run_id => ?, token => ?)")) {
            end.setLong(1, runId);
            end.setLong(2, token);
            end.executeQuery().close();
        } catch (SQLException err) {
            result.put("end_error", describe(err));
        }
        return result;
    }

    // ---- tokens -----------------------------------------------------------

    // Acquire the job's lease `count` times (each acquire issues a new,
    // greater token) and find the newest token, once as long and once as the
    // strings a getString() gives.
    static Map<String, Object> tokensMode(Connection conn, String job, String owner, int count) throws SQLException {
        List<Long> tokens = new ArrayList<>();
        List<String> texts = new ArrayList<>();
        try (PreparedStatement st = conn.prepareStatement(
                "SELECT token, token::text AS token_text FROM ledger.acquire(job => ?, owner => ?, ttl => '1 minute')")) {
            for (int i = 0; i < count; i++) {
                st.setString(1, job);
                st.setString(2, owner);
                try (ResultSet rs = st.executeQuery()) {
                    if (!rs.next()) throw new IllegalStateException("job " + job + " is held by another owner");
                    tokens.add(rs.getLong("token"));
                    texts.add(rs.getString("token_text"));
                }
            }
        }
        long newest = tokens.stream().mapToLong(Long::longValue).max().getAsLong(); // 10 > 9: right
        String naive = texts.stream().reduce((a, b) -> b.compareTo(a) > 0 ? b : a).get(); // "9" > "10": wrong
        boolean current;
        try (PreparedStatement st = conn.prepareStatement("SELECT ledger.is_current(job => ?, token => ?) AS ok")) {
            st.setString(1, job);
            st.setLong(2, newest); // an int8 parameter: the server compares bigints
            try (ResultSet rs = st.executeQuery()) {
                rs.next();
                current = rs.getBoolean("ok");
            }
        }
        try (PreparedStatement st = conn.prepareStatement("SELECT ledger.release(job => ?, owner => ?, token => ?)")) {
            st.setString(1, job);
            st.setString(2, owner);
            st.setLong(3, newest);
            st.executeQuery().close();
        }
        // And why not double: past 2^53 it rounds, long stays exact.
        Map<String, Object> beyond = new LinkedHashMap<>();
        try (PreparedStatement st = conn.prepareStatement("SELECT 9007199254740993::bigint AS b, 9007199254740993::text AS t");
             ResultSet rs = st.executeQuery()) {
            rs.next();
            beyond.put("bigint", Long.toString(rs.getLong("b")));
            beyond.put("number", Long.toString((long) Double.parseDouble(rs.getString("t"))));
        }
        Map<String, Object> result = new LinkedHashMap<>();
        result.put("mode", "tokens");
        result.put("job", job);
        result.put("owner", owner);
        List<String> printed = new ArrayList<>();
        for (long t : tokens) printed.add(Long.toString(t));
        result.put("tokens", printed);
        result.put("newest", Long.toString(newest));
        result.put("naive_string_newest", naive);
        result.put("newest_was_current", current);
        result.put("beyond_2_53", beyond);
        return result;
    }

    // ---- guarded ----------------------------------------------------------

    // ledger.run_guarded is a procedure that COMMITs: it must be CALLed in
    // autocommit. pgjdbc sends every statement with the extended protocol
    // (a portal), so inside a transaction (setAutoCommit(false)) the
    // procedure cannot tell in advance and PostgreSQL refuses its first
    // COMMIT with 2D000 (invalid_transaction_termination), before it did
    // anything. (With preferQueryMode=simple it is 25001.) In autocommit it runs.
    static final String GUARDED_COMMAND =
        "INSERT INTO fenced_writes (token, written_by) "
        + "SELECT ledger.fence(job => current_setting('ledger.job'), resource => 'fenced_writes:' || current_setting('ledger.job'), "
        + "token => current_setting('ledger.token')::bigint), current_setting('ledger.owner')";

    static Map<String, Object> guardedMode(Connection conn, String job, String owner) throws SQLException {
        Map<String, Object> result = new LinkedHashMap<>();
        result.put("mode", "guarded");
        result.put("job", job);
        result.put("owner", owner);
        String call = "CALL ledger.run_guarded(job => ?, command => ?, owner => ?, ttl => '1 minute')";
        conn.setAutoCommit(false);
        try (PreparedStatement st = conn.prepareStatement(call)) {
            st.setString(1, job);
            st.setString(2, GUARDED_COMMAND);
            st.setString(3, owner);
            st.execute();
            result.put("in_transaction", null);
        } catch (SQLException err) {
            result.put("in_transaction", describe(err));
        } finally {
            conn.rollback();
            conn.setAutoCommit(true);
        }
        try (PreparedStatement st = conn.prepareStatement(call)) {
            st.setString(1, job);
            st.setString(2, GUARDED_COMMAND);
            st.setString(3, owner);
            st.execute();
            result.put("autocommit", null);
        } catch (SQLException err) {
            result.put("autocommit", describe(err));
        }
        return result;
    }

    // ---- the command line -------------------------------------------------

    static String iso(OffsetDateTime t) {
        return t.withOffsetSameInstant(ZoneOffset.UTC).format(DateTimeFormatter.ofPattern("uuuu-MM-dd'T'HH:mm:ss.SSSSSSX"));
    }

    static void usage() {
        System.err.println("usage: java Run run <job> <owner> [--resource=R] [--ttl=SECONDS] [--work-ms=N] [--key=K]\n"
            + "       java Run zombie <job> <owner> <run_id> <token>\n"
            + "       java Run tokens <job> <owner> [count]\n"
            + "       java Run guarded <job> <owner>\n"
            + "       java Run worker <job> <owner> [--ttl=SECONDS] [--work-ms=N]   (one run per line on stdin)");
        System.exit(64);
    }

    public static void main(String[] argv) {
        List<String> args = new ArrayList<>();
        Map<String, String> opts = new LinkedHashMap<>();
        for (String a : argv) {
            if (a.startsWith("--") && a.contains("=")) opts.put(a.substring(2, a.indexOf('=')), a.substring(a.indexOf('=') + 1));
            else args.add(a);
        }
        if (args.size() < 3) usage();
        String mode = args.get(0);
        String job = args.get(1);
        String owner = args.get(2);
        try {
            switch (mode) {
                case "run":
                    // Two connections: the ledger's calls run in autocommit on
                    // one, the application's transaction on the other.
                    try (Connection ledger = connect(); Connection app = connect()) {
                        System.out.println(Json.write(runMode(ledger, app, job, owner, opts)));
                    }
                    break;
                case "worker":
                    // A long-lived worker keeps its two connections and runs
                    // the job once per line on stdin (a scheduler's tick):
                    // the way pooled applications really use a connection.
                    try (Connection ledger = connect(); Connection app = connect()) {
                        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
                        while (in.readLine() != null) {
                            System.out.println(Json.write(runMode(ledger, app, job, owner, opts)));
                            System.out.flush();
                        }
                    }
                    break;
                case "zombie":
                    if (args.size() < 5) usage();
                    try (Connection conn = connect()) {
                        System.out.println(Json.write(zombieMode(conn, job, owner, Long.parseLong(args.get(3)), Long.parseLong(args.get(4)))));
                    }
                    break;
                case "tokens":
                    try (Connection conn = connect()) {
                        System.out.println(Json.write(tokensMode(conn, job, owner, args.size() > 3 ? Integer.parseInt(args.get(3)) : 10)));
                    }
                    break;
                case "guarded":
                    try (Connection conn = connect()) {
                        System.out.println(Json.write(guardedMode(conn, job, owner)));
                    }
                    break;
                default:
                    usage();
            }
        } catch (Exception err) {
            err.printStackTrace();
            System.exit(1);
        }
    }

    // ---- JSON output (the JDK has no JSON library) ------------------------

    static final class Json {
        // Text that is JSON already (a DETAIL the server built with jsonb): written as is.
        record Raw(String json) {}

        static String write(Object v) {
            StringBuilder sb = new StringBuilder();
            write(sb, v);
            return sb.toString();
        }

        static void write(StringBuilder sb, Object v) {
            if (v == null) {
                sb.append("null");
            } else if (v instanceof Raw) {
                sb.append(((Raw) v).json());
            } else if (v instanceof Boolean || v instanceof Integer) {
                sb.append(v);
            } else if (v instanceof Map) {
                sb.append('{');
                boolean first = true;
                for (Map.Entry<?, ?> e : ((Map<?, ?>) v).entrySet()) {
                    if (!first) sb.append(',');
                    first = false;
                    write(sb, String.valueOf(e.getKey()));
                    sb.append(':');
                    write(sb, e.getValue());
                }
                sb.append('}');
            } else if (v instanceof List) {
                sb.append('[');
                boolean first = true;
                for (Object item : (List<?>) v) {
                    if (!first) sb.append(',');
                    first = false;
                    write(sb, item);
                }
                sb.append(']');
            } else {
                String s = v.toString();
                sb.append('"');
                for (int i = 0; i < s.length(); i++) {
                    char c = s.charAt(i);
                    if (c == '"' || c == '\\') sb.append('\\').append(c);
                    else if (c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0) || c == 0x2028 || c == 0x2029) sb.append(String.format("\\u%04x", (int) c));
                    else sb.append(c);
                }
                sb.append('"');
            }
        }
    }
}
