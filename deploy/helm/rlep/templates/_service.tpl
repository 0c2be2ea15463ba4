{{/*
A service Deployment + Service pair (verifier, replay, eval share it). Argument:
  (dict "root" $ "name" "verifier" "values" .Values.verifier "grpcPort" 50061 "metricsPort" 9461
        "healthPort" 50071 "httpPort" 0 "env" list "extraVolumes" list "extraMounts" list "initContainers" list
        "configPath" "/etc/rlep/config/verifier.yaml" "podSecurityContext" dict)
podSecurityContext: the pod's own, instead of the chart's (the sandbox's: Unconfined seccomp for bubblewrap).
grpcPort > 0: gRPC probes, on healthPort (the config's server.health_port: plaintext, answered apart from the
data port's calls); httpPort > 0: HTTP probes on /healthz and /metrics on that port.
*/}}
{{- define "rlep.service" -}}
{{- $root := .root }}
{{- $fullname := printf "%s-%s" (include "rlep.fullname" $root) .name }}
{{- $selector := include "rlep.selectorLabels" (dict "root" $root "component" .name) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}
  labels:
    {{- include "rlep.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .name }}
spec:
  replicas: {{ .values.replicas }}
  selector:
    matchLabels:
      {{- $selector | nindent 6 }}
  template:
    metadata:
      labels:
        {{- $selector | nindent 8 }}
      annotations:
        # Roll the pods when their config changes.
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    spec:
      securityContext:
        {{- toYaml (.podSecurityContext | default $root.Values.podSecurityContext) | nindent 8 }}
      {{- include "rlep.podPlacement" (dict "root" $root "component" .values) | nindent 6 }}
      {{- with .initContainers }}
      initContainers:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .name }}
          image: {{ include "rlep.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command:
            - rlep
            - serve
            - {{ .name }}
            - --config={{ .configPath | default (printf "/etc/rlep/config/%s.yaml" .name) }}
          {{- with concat (.env | default list) (include "rlep.tlsEnv" $root | fromYamlArray) }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            {{- if .grpcPort }}
            - { name: grpc, containerPort: {{ .grpcPort }} }
            {{- end }}
            {{- if .metricsPort }}
            - { name: metrics, containerPort: {{ .metricsPort }} }
            {{- end }}
            {{- if .healthPort }}
            - { name: health, containerPort: {{ .healthPort }} }
            {{- end }}
            {{- if .httpPort }}
            - { name: http, containerPort: {{ .httpPort }} }
            {{- end }}
          {{- if .grpcPort }}
          {{- include "rlep.grpcProbes" (dict "port" .healthPort) | nindent 10 }}
          {{- else }}
          startupProbe:
            httpGet: { path: /healthz, port: http{{ if $root.Values.tls.secretName }}, scheme: HTTPS{{ end }} }
            periodSeconds: 5
            failureThreshold: 60
          readinessProbe:
            httpGet: { path: /healthz, port: http{{ if $root.Values.tls.secretName }}, scheme: HTTPS{{ end }} }
            periodSeconds: 10
          livenessProbe:
            httpGet: { path: /healthz, port: http{{ if $root.Values.tls.secretName }}, scheme: HTTPS{{ end }} }
            periodSeconds: 20
          {{- end }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          resources:
            {{- toYaml .values.resources | nindent 12 }}
          volumeMounts:
            {{- include "rlep.commonMounts" $root | nindent 12 }}
            {{- with .extraMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "rlep.configVolume" $root | nindent 8 }}
        {{- include "rlep.tokenVolume" $root | nindent 8 }}
        {{- include "rlep.tlsVolume" $root | nindent 8 }}
        {{- with .extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $fullname }}
  labels:
    {{- include "rlep.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .name }}
    # The ServiceMonitor scrapes every Service carrying this label.
    rlep.io/metrics: "true"
spec:
  selector:
    {{- $selector | nindent 4 }}
  ports:
    {{- if .grpcPort }}
    - { name: grpc, port: {{ .grpcPort }}, targetPort: grpc, appProtocol: grpc }
    {{- end }}
    {{- if .metricsPort }}
    - { name: metrics, port: {{ .metricsPort }}, targetPort: metrics }
    {{- end }}
    {{- if .httpPort }}
    - { name: http, port: {{ .httpPort }}, targetPort: http }
    {{- end }}
{{- end -}}
